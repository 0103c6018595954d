package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/ptr"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/deployments/helm"
	"github.com/tessera-dev/tessera/driver/daemonpod"
	"github.com/tessera-dev/tessera/driver/imex"
	"github.com/tessera-dev/tessera/test/chartnode"
	"github.com/tessera-dev/tessera/test/cluster"
	"github.com/tessera-dev/tessera/test/gpunode"
	"github.com/tessera-dev/tessera/test/helmrelease"
)

// TestIMEXDaemonsServeATwoNodeGangOnGB200Trays installs the Helm chart with
// its defaults (IMEX daemons on) on two real-runtime nodes simulating GB200
// trays of one NVLink clique, and runs a gang of two members, a whole tray
// each, sharing a domain claim. Before either member's container starts,
// the plugin of each tray runs an IMEX daemon pod (Tessera's image, the
// stand-in nvidia-imex of the simulated driver root, under runc, in the
// host's network) whose nodes configuration lists exactly the two trays'
// InternalIPs; each daemon read it (its log lists both addresses), listens
// on its own tray's address and is ready (the kubelet's TCP probe); the
// gang reports IMEXReady. Once the members are gone, both daemons and
// their configuration directories are gone too.
func TestIMEXDaemonsServeATwoNodeGangOnGB200Trays(t *testing.T) {
	t.Parallel()
	start := time.Now()
	_, ctx := ktesting.NewTestContext(t)
	// The image first: the build is shared, and the test's ten minutes
	// are for what it does with it.
	archive := buildTesseraImage(ctx, t)
	ctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	trays := []string{"tray-1", "tray-2"}
	var specs []cluster.NodeSpec
	for _, name := range trays {
		specs = append(specs, cluster.NodeSpec{Name: name, Runtime: cluster.RealContainerd, Labels: chartnode.GPUNodeLabel})
	}
	c := cluster.StartT(t, cluster.Options{Nodes: specs})
	tc := &tesseraCluster{Cluster: c}
	client := c.Client()
	ns := helm.DefaultRelease.Namespace
	steps := map[string]realNodeSteps{}
	for _, name := range trays {
		steps[name] = realNodeSteps{t: t, node: c.Node(name)}
	}
	first := steps[trays[0]]

	step := "Tessera's image is imported into both trays' containerd and the chart installed"
	t0 := time.Now()
	for _, name := range trays {
		if err := c.Node(name).ImportImages(ctx, archive); err != nil {
			first.fail(step, "%s: %v", name, err)
		}
	}
	release, err := helmrelease.New(ctx, "../..", filepath.Join(t.TempDir(), "helm"), c.AdminKubeconfig(), ns)
	if err != nil {
		first.fail(step, "%v", err)
	}
	values, err := chartnode.Values(c, tesseraImage, "gb200-nvl72-tray")
	if err != nil {
		t.Fatal(err)
	}
	pluginValues := values["kubeletPlugin"].(map[string]any)
	pluginValues["extraEnv"] = append(pluginValues["extraEnv"].([]any), map[string]any{"name": "FAKE_CLIQUE", "value": cliqueA})
	if err := release.Install(ctx, helm.DefaultRelease.Name, values); err != nil {
		first.fail(step, "%v", err)
	}
	for _, name := range trays {
		waitForPluginPod(ctx, steps[name], client, ns, name, tesseraImage, "", step)
		if _, err := gpunode.WaitForSlices(ctx, client, name, 2*time.Minute); err != nil {
			steps[name].fail(step, "%v", err)
		}
	}
	waitForComponentPod(ctx, first, c, ns, "controller", tesseraImage)
	waitDomains(ctx, t, tc, map[string]int{poolA: 2})
	t.Logf("%s: %v", step, time.Since(t0).Round(time.Millisecond))

	step = "a gang of two whole trays runs, each member after its tray's IMEX daemon is ready"
	t0 = time.Now()
	const wl = "train"
	if err := c.CreateNamespace(ctx, wl); err != nil {
		t.Fatal(err)
	}
	tc.createTemplates(ctx, t, gpuTemplate(wl, "tray", 4))
	if _, err := client.ResourceV1().ResourceClaims(wl).Create(ctx, domainClaim(wl, "train-domain"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	gs := newGangs(t, c)
	gs.create(ctx, t, labelGang(wl, "train", 2, "train-domain"))
	var members []*corev1.Pod
	for i := range 2 {
		p := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("train-%d", i), Namespace: wl, Labels: map[string]string{"gang": "train"}},
			Spec: corev1.PodSpec{
				RestartPolicy:                 corev1.RestartPolicyNever,
				TerminationGracePeriodSeconds: ptr.To[int64](1),
				SchedulingGates:               []corev1.PodSchedulingGate{{Name: gangv1.SchedulingGate}},
				ResourceClaims: []corev1.PodResourceClaim{
					{Name: "gpu", ResourceClaimTemplateName: ptr.To("tray")},
					{Name: "domain", ResourceClaimName: ptr.To("train-domain")},
				},
				Containers: []corev1.Container{{
					Name: "main", Image: cluster.BusyboxImage, ImagePullPolicy: corev1.PullNever,
					Command:   []string{"sh", "-c", "env | sed 's/^/ENV /'\necho END\nexec sleep 3600"},
					Resources: corev1.ResourceRequirements{Claims: []corev1.ResourceClaim{{Name: "gpu"}, {Name: "domain"}}},
				}},
			},
		}
		if _, err := client.CoreV1().Pods(wl).Create(ctx, p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		members = append(members, p)
	}
	placed := map[string]bool{}
	for _, m := range members {
		var p *corev1.Pod
		err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
			var err error
			p, err = client.CoreV1().Pods(wl).Get(ctx, m.Name, metav1.GetOptions{})
			return err == nil && p.Spec.NodeName != "", nil
		})
		if err != nil {
			first.fail(step, "member %s not bound to a tray: %v\n%s", m.Name, err, describeConditions(gs.get(ctx, t, wl, "train")))
		}
		steps[p.Spec.NodeName].wait(ctx, tc, step, m)
		placed[p.Spec.NodeName] = true
	}
	if len(placed) != 2 {
		first.fail(step, "members placed on %v, want one on each tray", placed)
	}
	domainClaim, err := client.ResourceV1().ResourceClaims(wl).Get(ctx, "train-domain", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%s: %v", step, time.Since(t0).Round(time.Millisecond))

	step = "each tray's IMEX daemon lists exactly both trays, listens on its own address and is ready"
	t0 = time.Now()
	wantConfig := c.Node(trays[0]).IP() + "\n" + c.Node(trays[1]).IP() + "\n"
	daemons, err := client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: daemonpod.LabelApp + "=" + imex.AppName})
	if err != nil {
		t.Fatal(err)
	}
	var onNodes []string
	for _, d := range daemons.Items {
		onNodes = append(onNodes, d.Spec.NodeName)
		s := steps[d.Spec.NodeName]
		if d.Labels[daemonpod.LabelClaimUID] != string(domainClaim.UID) || !podIsReady(&d) {
			s.fail(step, "IMEX daemon %s: claim %s, ready %v; want the domain claim %s's, ready", d.Name, d.Labels[daemonpod.LabelClaimUID], podIsReady(&d), domainClaim.UID)
		}
		own := c.Node(d.Spec.NodeName).IP()
		if d.Status.HostIP != own {
			s.fail(step, "IMEX daemon %s runs at %s, want its tray's address %s", d.Name, d.Status.HostIP, own)
		}
		dir := filepath.Join(c.Node(d.Spec.NodeName).KubeletRootDir(), "plugins", driverName, "imex", string(domainClaim.UID))
		got, err := os.ReadFile(filepath.Join(dir, imex.NodesConfigFile))
		if err != nil || string(got) != wantConfig {
			s.fail(step, "tray %s's IMEX nodes configuration %q (%v), want %q", d.Spec.NodeName, got, err, wantConfig)
		}
		log, err := c.Node(d.Spec.NodeName).ContainerLog(ns, d.Name, string(d.UID), "imex-daemon")
		want := []string{"IMEX node 0: " + c.Node(trays[0]).IP(), "IMEX node 1: " + c.Node(trays[1]).IP(), fmt.Sprintf("IMEX daemon listening on %s:%d, 2 nodes", own, imex.DefaultPort)}
		for _, line := range want {
			if err != nil || !strings.Contains(log, line+"\n") {
				s.fail(step, "IMEX daemon %s's log lacks %q (%v):\n%s", d.Name, line, err, log)
			}
		}
	}
	slices.Sort(onNodes)
	if !slices.Equal(onNodes, trays) {
		first.fail(step, "IMEX daemons on %v, want one on each tray %v", onNodes, trays)
	}
	gs.waitCondition(ctx, t, wl, "train", gangv1.ConditionIMEXReady, metav1.ConditionTrue, time.Minute)
	t.Logf("%s: %v", step, time.Since(t0).Round(time.Millisecond))

	step = "once the members are gone, so are both daemons and their configuration"
	t0 = time.Now()
	tc.deletePodsAndWait(ctx, t, members...)
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		left, err := client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: daemonpod.LabelApp + "=" + imex.AppName})
		return err == nil && len(left.Items) == 0, nil
	})
	if err != nil {
		first.fail(step, "IMEX daemon pods left after the gang: %v", err)
	}
	for _, name := range trays {
		dir := filepath.Join(c.Node(name).KubeletRootDir(), "plugins", driverName, "imex", string(domainClaim.UID))
		if _, err := os.Stat(dir); !os.IsNotExist(err) {
			steps[name].fail(step, "tray %s keeps the daemon's directory %s: %v", name, dir, err)
		}
	}
	t.Logf("%s: %v", step, time.Since(t0).Round(time.Millisecond))
	t.Logf("test took %v", time.Since(start).Round(time.Millisecond))
}

func podIsReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}
