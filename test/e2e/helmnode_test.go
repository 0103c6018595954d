package e2e

import (
	"context"
	"encoding/base64"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/ptr"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/deployments/helm"
	"github.com/tessera-dev/tessera/deployments/rbac"
	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/domain"
	"github.com/tessera-dev/tessera/driver/fakenode"
	"github.com/tessera-dev/tessera/driver/mps"
	"github.com/tessera-dev/tessera/test/chartnode"
	"github.com/tessera-dev/tessera/test/cluster"
	"github.com/tessera-dev/tessera/test/gpunode"
	"github.com/tessera-dev/tessera/test/helmrelease"
	"github.com/tessera-dev/tessera/webhook/webhooktest"
)

// tesseraImage is the name Tessera's image, built by test/ociimage, has on
// real-runtime nodes; upgradeImage is the same image under the tag a helm
// upgrade moves to.
const (
	tesseraImage = "tessera.test/tessera:e2e"
	upgradeImage = "tessera.test/tessera:e2e-upgrade"
)

// tesseraImageBuild is the one build of Tessera's image that the tests
// share (in imageDir, which TestMain creates and removes): every test that
// runs the image runs the same binaries, so one build serves them all.
var tesseraImageBuild struct {
	once     sync.Once
	done     chan struct{} // closed when the build ended
	archive  string
	err      error
	duration time.Duration
}

// imageDir holds the shared build of Tessera's image.
var imageDir string

// startTesseraImageBuild starts the package's one build of Tessera's image
// in the background, unless it started already. TestMain starts it before
// a run of the whole package: the build is mostly CPU and the tests mostly
// wait, so it is done by the time a test needs the image.
func startTesseraImageBuild() {
	b := &tesseraImageBuild
	b.once.Do(func() {
		b.done = make(chan struct{})
		go func() {
			defer close(b.done)
			start := time.Now()
			b.archive, b.err = chartnode.BuildImage(context.Background(), "../..", imageDir, tesseraImage, upgradeImage)
			b.duration = time.Since(start)
		}()
	})
}

// buildTesseraImage returns the OCI archive of Tessera's image, built as
// `make image-oci` does and named tesseraImage and upgradeImage, once for
// the whole package: it starts the build if nothing did, and waits for it.
func buildTesseraImage(ctx context.Context, t *testing.T) string {
	t.Helper()
	startTesseraImageBuild()
	b := &tesseraImageBuild
	waited := time.Now()
	select {
	case <-b.done:
	case <-ctx.Done():
		t.Fatalf("waiting for the build of Tessera's image: %v", context.Cause(ctx))
	}
	if b.err != nil {
		t.Fatalf("%v (the package's one build of Tessera's image failed)", b.err)
	}
	t.Logf("Tessera's image built in %v; this test waited %v for it", b.duration.Round(time.Millisecond), time.Since(waited).Round(time.Millisecond))
	return b.archive
}

// TestHelmChartRunsThePluginOnARealRuntimeNode installs the Helm chart with
// helm (helm install --create-namespace) on a cluster with a real-runtime
// node (containerd, runc) that holds Tessera's image built without a
// container engine, with the chart's defaults (pods in the pod network,
// the plugin's surge update) and the webhook turned on with a Secret of our
// own. The DaemonSet's pod runs the plugin from that image under runc,
// simulating a DGX H100 in a multi-node NVLink clique (kubeletPlugin.fakeNode,
// FAKE_CLIQUE); it registers with the kubelet through the registration
// directory mounted from the node, and publishes the node's ResourceSlices
// with the token the kubelet projected into it: the API server's audit log
// shows the write came from the plugin's service account with a token bound
// to the node and the pod. With that same token the node-lock policy refuses
// a slice of another node. The API server calls the webhook's pod through
// its Service (checkWebhookPod); the controller's pod leads
// (checkControllerPod). A pod with a one-GPU claim then runs on the node
// under runc and sees its GPU's device nodes, environment and driver file,
// and only its GPU (gpuProbe); its image, a /usr/lib64 layout, finds
// libcuda.so.1 in the loader cache the chart's tessera-cdi-hook wrote
// (checkGPUPod). A pod with a 1g.10gb partition sees its parent GPU and
// exactly its partition's MIG capability nodes (checkMIGPod); one with a
// claim on the NVLink domain the controller published sees its IMEX channel
// (checkDomainPod). Then the operator's life cycle: helm upgrade while pods
// hold a GPU and a partition (checkUpgradeKeepsHeldGPUs), a deleted plugin
// pod (checkPluginPodReplaced), a drain (checkDrain) and helm uninstall
// (checkUninstalled).
func TestHelmChartRunsThePluginOnARealRuntimeNode(t *testing.T) {
	t.Parallel()
	start := time.Now()
	_, ctx := ktesting.NewTestContext(t)
	// The image first: the build is shared, and the test's ten minutes
	// are for what it does with it.
	archive := buildTesseraImage(ctx, t)
	ctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	// An H100 node in a multi-node NVLink clique (cliqueA, FAKE_CLIQUE
	// below), which the controller makes a domain of. (A GB200 tray has one
	// of its own, but its driver is aarch64's and this machine's image is
	// amd64.)
	const nodeName, profile, migProfile = "real-1", "dgx-h100", "1g.10gb"
	c := cluster.StartT(t, cluster.Options{Nodes: []cluster.NodeSpec{{
		Name: nodeName, Runtime: cluster.RealContainerd,
		Labels: chartnode.GPUNodeLabel,
	}}})
	node := c.Node(nodeName)
	ns := helm.DefaultRelease.Namespace
	steps := realNodeSteps{t: t, node: node}
	var pluginPod *corev1.Pod
	steps.logs = func() string {
		if pluginPod == nil {
			return ""
		}
		out, err := node.ContainerLog(ns, pluginPod.Name, string(pluginPod.UID), "plugin")
		if err != nil {
			return fmt.Sprintf("==== the plugin's container log: %v\n", err)
		}
		lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
		return fmt.Sprintf("==== last lines of the plugin's container log\n%s\n", strings.Join(lines[max(0, len(lines)-40):], "\n"))
	}

	step := "Tessera's image is imported into the node's containerd"
	t0 := time.Now()
	if err := node.ImportImages(ctx, archive); err != nil {
		steps.fail(step, "%v", err)
	}
	t.Logf("%s: %v", step, time.Since(t0).Round(time.Millisecond))

	step = "helm install --create-namespace installs the chart"
	t0 = time.Now()
	release, err := helmrelease.New(ctx, "../..", filepath.Join(t.TempDir(), "helm"), c.AdminKubeconfig(), ns)
	if err != nil {
		steps.fail(step, "%v", err)
	}
	values, err := chartnode.Values(c, tesseraImage, profile)
	if err != nil {
		t.Fatal(err)
	}
	values["webhook"] = webhookValues(ctx, t, c, ns)
	pluginValues := values["kubeletPlugin"].(map[string]any)
	pluginValues["extraEnv"] = append(pluginValues["extraEnv"].([]any), map[string]any{"name": "FAKE_CLIQUE", "value": cliqueA})
	if err := release.Install(ctx, helm.DefaultRelease.Name, values); err != nil {
		steps.fail(step, "%v", err)
	}
	t.Logf("%s: %v", step, time.Since(t0).Round(time.Millisecond))

	step = "the DaemonSet's pod runs the plugin from Tessera's image under runc"
	t0 = time.Now()
	pluginPod = waitForPluginPod(ctx, steps, c.Client(), ns, nodeName, tesseraImage, "", step)
	status := pluginPod.Status.ContainerStatuses[0]
	id, found := strings.CutPrefix(status.ContainerID, "containerd://")
	if !found {
		steps.fail(step, "the plugin's container ID %q is not containerd's", status.ContainerID)
	}
	if _, err := os.Stat(filepath.Join(node.RuncRoot(), "k8s.io", id, "state.json")); err != nil {
		steps.fail(step, "runc keeps no state of the plugin's container: %v", err)
	}
	t.Logf("%s: %v", step, time.Since(t0).Round(time.Millisecond))

	step = "the plugin registers with the kubelet and publishes the node's slices"
	t0 = time.Now()
	if _, err := gpunode.WaitForSlices(ctx, c.Client(), nodeName, 2*time.Minute); err != nil {
		steps.fail(step, "%v", err)
	}
	// The chart runs the plugin in rolling-update mode: its sockets are
	// named after its pod.
	if _, err := os.Stat(filepath.Join(node.RegistrarDir(), driverName+"-"+string(pluginPod.UID)+"-reg.sock")); err != nil {
		steps.fail(step, "no registration socket of pod %s in the kubelet's plugin-registration dir: %v", pluginPod.Name, err)
	}
	t.Logf("%s: %v", step, time.Since(t0).Round(time.Millisecond))

	step = "the slices were written with the node-bound token the kubelet projected"
	checkSliceWriter(steps, step, c, pluginPod, nodeName)

	step = "the node-lock policy refuses that token another node's slice"
	token := projectedToken(steps, step, node, pluginPod)
	plugin := bearerClient(t, c.RESTConfig(), token)
	foreign := &resourceapi.ResourceSlice{
		ObjectMeta: metav1.ObjectMeta{Name: "foreign"},
		Spec: resourceapi.ResourceSliceSpec{Driver: driverName, NodeName: ptr.To("other-node"),
			Pool: resourceapi.ResourcePool{Name: "other-node", ResourceSliceCount: 1}, Devices: []resourceapi.Device{{Name: "gpu-0"}}},
	}
	if _, err := plugin.ResourceV1().ResourceSlices().Create(ctx, foreign, metav1.CreateOptions{}); err == nil || !strings.Contains(err.Error(), "may only write ResourceSlices of its own node") {
		steps.fail(step, "the plugin's projected token wrote another node's slice, or was refused for another reason: %v", err)
	}

	fake, err := fakenode.New(profile, fakenode.Options{Dir: t.TempDir(), NodeName: nodeName})
	if err != nil {
		t.Fatal(err)
	}
	tc := &tesseraCluster{Cluster: c, nodes: map[string]*gpuNode{nodeName: {&gpunode.Node{Node: node, Fake: fake}}}}
	if err := c.CreateNamespace(ctx, "workloads"); err != nil {
		t.Fatal(err)
	}
	waitForComponentPod(ctx, steps, c, ns, "webhook", tesseraImage)
	checkWebhookPod(ctx, steps, c, ns, "workloads")
	checkControllerPod(ctx, steps, c, ns, tesseraImage)
	checkGPUPod(ctx, t, tc, steps, "workloads", nodeName, true)
	checkMIGPod(ctx, t, tc, steps, "workloads", nodeName, migProfile)
	checkDomainPod(ctx, t, tc, steps, "workloads", nodeName)
	checkMPSPod(ctx, t, tc, steps, "workloads", nodeName)
	pluginPod = checkUpgradeKeepsHeldGPUs(ctx, t, tc, steps, release, values, pluginPod, "workloads", nodeName, migProfile)
	pluginPod = checkPluginPodReplaced(ctx, t, tc, steps, pluginPod, "workloads", nodeName)
	checkDrain(ctx, t, tc, steps, pluginPod, "workloads", nodeName)

	step = "helm uninstall removes the plugin; the node keeps no slice, CDI spec, prepared claim, MPS daemon or MIG instance"
	t0 = time.Now()
	if err := release.Uninstall(ctx, helm.DefaultRelease.Name); err != nil {
		steps.fail(step, "%v", err)
	}
	checkUninstalled(ctx, steps, step, c, node, nodeName)
	t.Logf("%s: %v", step, time.Since(t0).Round(time.Millisecond))
	t.Logf("test took %v", time.Since(start).Round(time.Millisecond))
}

// webhookValues are the chart's values that run the admission webhook on
// the cluster's real-runtime nodes with a serving certificate for its
// Service's name in namespace ns, signed by a throwaway CA, in the Secret
// the chart names (created here, in ns, as an operator without cert-manager
// does).
func webhookValues(ctx context.Context, t *testing.T, c *cluster.Cluster, ns string) map[string]any {
	t.Helper()
	ca := webhooktest.NewCA(t)
	_, cert, key := ca.Issue(t, "tessera-webhook."+ns+".svc")
	if err := c.CreateNamespace(ctx, ns); err != nil {
		t.Fatal(err)
	}
	const secret = "tessera-webhook-tls"
	if _, err := c.Client().CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: secret, Namespace: ns},
		Type:       corev1.SecretTypeTLS,
		Data:       map[string][]byte{corev1.TLSCertKey: cert, corev1.TLSPrivateKeyKey: key},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create the webhook's TLS Secret: %v", err)
	}
	return map[string]any{
		"enabled":      true,
		"nodeSelector": chartnode.RealRuntimeNodes,
		"tls":          map[string]any{"secretName": secret, "caBundle": base64.StdEncoding.EncodeToString(ca.PEM)},
	}
}

// checkWebhookPod checks that the API server calls the chart's webhook pod
// through its Service: a claim in namespace ns whose Tessera configuration
// is out of range is refused with the webhook's message naming the field,
// and a valid one is admitted. The API server may call the webhook only
// once its pod is ready and in the Service's endpoints; until then its
// failure policy refuses every claim with a Tessera configuration, with
// another message.
func checkWebhookPod(ctx context.Context, steps realNodeSteps, c *cluster.Cluster, releaseNS, ns string) {
	steps.t.Helper()
	step := "the API server calls the webhook's pod through its Service"
	t0 := time.Now()
	const (
		bad   = `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","mpsConfig":{"defaultActiveThreadPercentage":150}}}`
		valid = `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","mpsConfig":{"defaultActiveThreadPercentage":50}}}`
	)
	claims := c.Client().ResourceV1().ResourceClaims(ns)
	var last error
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		claim := webhookClaim("webhook-bad", driverName, bad)
		if _, last = claims.Create(ctx, claim, metav1.CreateOptions{}); last == nil {
			return false, fmt.Errorf("a claim with defaultActiveThreadPercentage 150 was admitted")
		}
		return strings.Contains(last.Error(), "defaultActiveThreadPercentage") && strings.Contains(last.Error(), "between 1 and 100"), nil
	})
	if err != nil {
		steps.fail(step, "no refusal from the webhook within 2m: %v; last answer: %v\n%s", err, last, webhookPodLog(ctx, c, releaseNS))
	}
	good := webhookClaim("webhook-good", driverName, valid)
	if _, err := claims.Create(ctx, good, metav1.CreateOptions{}); err != nil {
		steps.fail(step, "a valid claim was refused: %v", err)
	}
	if err := claims.Delete(ctx, good.Name, metav1.DeleteOptions{}); err != nil {
		steps.fail(step, "delete claim %s: %v", good.Name, err)
	}
	steps.t.Logf("%s: %v", step, time.Since(t0).Round(time.Millisecond))
}

// webhookPodLog is the last lines of the webhook pods' logs, through the
// API server.
func webhookPodLog(ctx context.Context, c *cluster.Cluster, ns string) string {
	pods, err := c.Client().CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=webhook"})
	if err != nil {
		return err.Error()
	}
	var out []string
	for _, p := range pods.Items {
		log, err := c.Client().CoreV1().Pods(ns).GetLogs(p.Name, &corev1.PodLogOptions{TailLines: ptr.To[int64](20)}).DoRaw(ctx)
		out = append(out, fmt.Sprintf("==== pod %s (%s): %v\n%s", p.Name, p.Status.Phase, err, log))
	}
	return strings.Join(out, "\n")
}

// checkControllerPod checks that the chart's gang controller runs as one
// pod from image on a real-runtime node and holds the leader lease: it
// reached the API server from the pod network with its own token.
func checkControllerPod(ctx context.Context, steps realNodeSteps, c *cluster.Cluster, ns, image string) {
	steps.t.Helper()
	step := "the controller runs from " + image + " and leads"
	var last string
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		var p *corev1.Pod
		if p, last = componentPod(ctx, c, ns, "controller", image); p == nil {
			return false, nil
		}
		// The identity is the pod's host name (its name), "_", a UUID.
		lease, err := c.Client().CoordinationV1().Leases(ns).Get(ctx, "tessera-controller", metav1.GetOptions{})
		if err != nil || lease.Spec.HolderIdentity == nil || !strings.HasPrefix(*lease.Spec.HolderIdentity, p.Name+"_") {
			last = fmt.Sprintf("pod %s runs; lease: %v %+v", p.Name, err, lease)
			return false, nil
		}
		return true, nil
	})
	if err != nil {
		steps.fail(step, "%s (%v)", last, err)
	}
}

// waitForComponentPod waits until the chart's component (controller,
// webhook) runs as one ready pod from image, and only that one.
func waitForComponentPod(ctx context.Context, steps realNodeSteps, c *cluster.Cluster, ns, component, image string) {
	steps.t.Helper()
	var last string
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		var p *corev1.Pod
		p, last = componentPod(ctx, c, ns, component, image)
		return p != nil, nil
	})
	if err != nil {
		steps.fail("the "+component+" runs from "+image, "%s (%v)", last, err)
	}
}

// componentPod returns the chart's component pod in ns if it is the only
// one, runs image and is ready; otherwise nil and what it found instead.
func componentPod(ctx context.Context, c *cluster.Cluster, ns, component, image string) (*corev1.Pod, string) {
	return chartnode.OnlyReadyPod(ctx, c.Client(), ns, metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=" + component}, component+" pods", image, "")
}

// checkDomainPod runs a one-member gang on node, its pod with a GPU and a
// claim for a channel of the NVLink domain the controller published for the
// node's clique (only the controller allocates channels), and checks from
// inside its container that it sees exactly that channel's IMEX device node
// and the domain's environment.
func checkDomainPod(ctx context.Context, t *testing.T, c *tesseraCluster, steps realNodeSteps, ns, node string) {
	t.Helper()
	step := "a pod with an NVLink domain claim sees its IMEX channel"
	t0 := time.Now()
	waitDomains(ctx, t, c, map[string]int{poolA: 1})
	client := c.Client()
	if _, err := client.ResourceV1().ResourceClaims(ns).Create(ctx, domainClaim(ns, "domain"), metav1.CreateOptions{}); err != nil {
		steps.fail(step, "create the domain claim: %v", err)
	}
	pod := withClaim(busyboxPod(ns, "imex", node, `for f in /dev/nvidia-caps-imex-channels/*; do stat -c 'DEV %n %F %t %T' "$f"; done
env | sed 's/^/ENV /'`), "gpu", "one-gpu")
	pod.Spec.ResourceClaims = append(pod.Spec.ResourceClaims, corev1.PodResourceClaim{Name: "domain", ResourceClaimName: ptr.To("domain")})
	pod.Spec.Containers[0].Resources.Claims = append(pod.Spec.Containers[0].Resources.Claims, corev1.ResourceClaim{Name: "domain"})
	pod.Labels = map[string]string{"gang": "imex"}
	pod.Spec.SchedulingGates = []corev1.PodSchedulingGate{{Name: gangv1.SchedulingGate}}
	gs := newGangs(t, c.Cluster)
	gs.create(ctx, t, labelGang(ns, "imex", 1, "domain"))
	pod, out := steps.run(ctx, c, step, pod)
	claim, err := client.ResourceV1().ResourceClaims(ns).Get(ctx, "domain", metav1.GetOptions{})
	if err != nil || claim.Status.Allocation == nil || len(claim.Status.Allocation.Devices.Results) != 1 {
		steps.fail(step, "the domain claim: %v %+v", err, claim)
	}
	channel, err := domain.ParseDevice(claim.Status.Allocation.Devices.Results[0].Device)
	if err != nil {
		steps.fail(step, "the domain claim's device: %v", err)
	}
	got := parseProbe(out)
	want := map[string]string{
		fmt.Sprintf("/dev/nvidia-caps-imex-channels/channel%d", channel): fmt.Sprintf("character special file %x %x", fakenode.IMEXMajor, channel),
	}
	if !maps.Equal(got.devices, want) {
		steps.fail(step, "IMEX channel nodes %v, want %v\noutput:\n%s", got.devices, want, out)
	}
	if got.env[gangv1.EnvDomain] != cliqueA || got.env[gangv1.EnvChannel] != strconv.Itoa(channel) {
		steps.fail(step, "domain env %s=%q %s=%q, want %s and %d", gangv1.EnvDomain, got.env[gangv1.EnvDomain], gangv1.EnvChannel, got.env[gangv1.EnvChannel], cliqueA, channel)
	}
	c.deletePodsAndWait(ctx, t, pod)
	gs.delete(ctx, t, ns, "imex")
	if err := client.ResourceV1().ResourceClaims(ns).Delete(ctx, "domain", metav1.DeleteOptions{}); err != nil {
		steps.fail(step, "delete the domain claim: %v", err)
	}
	waitNoCDISpecs(ctx, t, c.nodes[node])
	t.Logf("%s: channel %d in %v", step, channel, time.Since(t0).Round(time.Millisecond))
}

// checkMPSPod runs a pod on node with a claim that shares a GPU through
// MPS: the plugin starts the claim's MPS control daemon as a pod from
// Tessera's image (the chart's default MPS image), which runs on the node
// under runc with the fake driver's daemon before the client's container
// starts; the client sees the pipe directory and its thread limit. Once
// the client and its claim are gone, so is the daemon pod.
func checkMPSPod(ctx context.Context, t *testing.T, c *tesseraCluster, steps realNodeSteps, ns, node string) {
	t.Helper()
	step := "an MPS client runs beside its claim's MPS daemon pod"
	t0 := time.Now()
	client := c.Client()
	claim := &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "mps-gpu", Namespace: ns},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
			Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "mps.gpu.tessera.dev"}}},
			Config: []resourceapi.DeviceClaimConfiguration{{DeviceConfiguration: webhookOpaque(driverName,
				`{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","mpsConfig":{"defaultActiveThreadPercentage":50}}}`)}},
		}},
	}
	claim, err := client.ResourceV1().ResourceClaims(ns).Create(ctx, claim, metav1.CreateOptions{})
	if err != nil {
		steps.fail(step, "create the MPS claim: %v", err)
	}
	pod := busyboxPod(ns, "mps-client", node, `env | sed 's/^/ENV /'; [ -d "$CUDA_MPS_PIPE_DIRECTORY" ] && echo PIPE-DIR`)
	pod.Spec.ResourceClaims = []corev1.PodResourceClaim{{Name: "gpu", ResourceClaimName: ptr.To(claim.Name)}}
	pod.Spec.Containers[0].Resources.Claims = []corev1.ResourceClaim{{Name: "gpu"}}
	pod, out := steps.run(ctx, c, step, pod)
	got := parseProbe(out)
	if got.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] != "50" || !strings.Contains(out, "PIPE-DIR\n") {
		steps.fail(step, "the MPS client lacks its pipe directory or its thread limit:\n%s", out)
	}
	daemon, err := client.CoreV1().Pods(helm.DefaultRelease.Namespace).Get(ctx, "tessera-mps-"+string(claim.UID), metav1.GetOptions{})
	if err != nil {
		steps.fail(step, "the claim's MPS daemon pod: %v", err)
	}
	if daemon.Spec.NodeName != node || daemon.Status.Phase != corev1.PodRunning || len(daemon.Status.ContainerStatuses) != 1 ||
		daemon.Status.ContainerStatuses[0].State.Running == nil || daemon.Status.ContainerStatuses[0].Image != tesseraImage {
		steps.fail(step, "MPS daemon pod %s on %q: %s %+v, want running %s on %s", daemon.Name, daemon.Spec.NodeName, daemon.Status.Phase, daemon.Status.ContainerStatuses, tesseraImage, node)
	}
	c.deletePodsAndWait(ctx, t, pod)
	if err := client.ResourceV1().ResourceClaims(ns).Delete(ctx, claim.Name, metav1.DeleteOptions{}); err != nil {
		steps.fail(step, "delete the MPS claim: %v", err)
	}
	if err := waitPodGone(ctx, client, daemon.Namespace, daemon.Name); err != nil {
		steps.fail(step, "the MPS daemon pod %s stays after its claim was unprepared: %v", daemon.Name, err)
	}
	waitNoCDISpecs(ctx, t, c.nodes[node])
	t.Logf("%s: %v", step, time.Since(t0).Round(time.Millisecond))
}

// waitForPluginPod waits until the DaemonSet's only pod on node, other than
// the pod with UID not (if set), runs image and is ready.
func waitForPluginPod(ctx context.Context, steps realNodeSteps, client kubernetes.Interface, ns, node, image string, not types.UID, step string) *corev1.Pod {
	steps.t.Helper()
	var pod *corev1.Pod
	var last string
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		pod, last = chartnode.PluginPod(ctx, client, ns, node, image, not)
		return pod != nil, nil
	})
	if err != nil {
		steps.fail(step, "no running plugin pod from image %s on node %s within 2m: %s", image, node, last)
	}
	return pod
}

// watchPluginOverlap watches the plugin pods on node from now on, and
// returns a function that stops watching and says "" if at some moment the
// pod with UID old ran (not terminating) while another plugin pod there
// was ready, else what it saw: the chart's surge update in the pod network
// starts the new plugin beside the old, which stops only once the new one
// has registered.
func watchPluginOverlap(ctx context.Context, t *testing.T, client kubernetes.Interface, ns, node string, old types.UID) func() string {
	t.Helper()
	w, err := client.CoreV1().Pods(ns).Watch(ctx, metav1.ListOptions{LabelSelector: chartnode.PluginSelector, FieldSelector: "spec.nodeName=" + node})
	if err != nil {
		t.Fatalf("watch the plugin pods on node %s: %v", node, err)
	}
	done := make(chan string, 1)
	go func() {
		oldRuns, newReady := true, map[types.UID]bool{}
		var seen []string
		for ev := range w.ResultChan() {
			p, ok := ev.Object.(*corev1.Pod)
			if !ok {
				continue
			}
			ready := p.DeletionTimestamp == nil && slices.ContainsFunc(p.Status.Conditions, func(c corev1.PodCondition) bool {
				return c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue
			})
			seen = append(seen, fmt.Sprintf("%s %s ready=%t", ev.Type, p.Name, ready))
			if p.UID == old {
				oldRuns = ev.Type != "DELETED" && p.DeletionTimestamp == nil
			} else {
				newReady[p.UID] = ready && ev.Type != "DELETED"
			}
			if oldRuns && slices.Contains(slices.Collect(maps.Values(newReady)), true) {
				done <- ""
				return
			}
		}
		done <- strings.Join(seen, "; ")
	}()
	return func() string {
		w.Stop()
		return <-done
	}
}

// heldGPUPod runs a pod on node holding one GPU through a claim made from
// template (a one-GPU template in ns) and returns it with its claim.
func heldGPUPod(ctx context.Context, t *testing.T, c *tesseraCluster, steps realNodeSteps, step, ns, name, template, node string) (*corev1.Pod, *resourceapi.ResourceClaim) {
	t.Helper()
	pod := withClaim(busyboxPod(ns, name, node, "ls /dev/nvidia[0-9]*"), "gpu", template)
	pod, out := steps.run(ctx, c, step, pod)
	if !strings.HasPrefix(out, "/dev/nvidia") {
		steps.fail(step, "pod %s lists no GPU device node: %q", name, out)
	}
	return pod, c.claimOf(ctx, t, pod, "gpu")
}

// checkUpgradeKeepsHeldGPUs upgrades the release to upgradeImage while a
// pod holds a GPU and another a partition of migProfile: the DaemonSet
// starts the new plugin pod beside the old one, which stops only once the
// new one is ready (registered); the held pods keep running with their
// claims' CDI specs and checkpoint entries and the partition; a pod created
// as the upgrade starts runs; the controller and webhook pods move to the
// new image; and the new plugin unprepares the claim the old one prepared
// when its pod is deleted, destroying the partition the old one created. It
// returns the new plugin pod.
func checkUpgradeKeepsHeldGPUs(ctx context.Context, t *testing.T, c *tesseraCluster, steps realNodeSteps, release *helmrelease.Client, values map[string]any, old *corev1.Pod, ns, nodeName, migProfile string) *corev1.Pod {
	t.Helper()
	n := c.nodes[nodeName]
	client := c.Client()
	step := "a pod holds a GPU before the upgrade"
	if _, err := client.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, gpuTemplate(ns, "held-gpu", 1), metav1.CreateOptions{}); err != nil {
		steps.fail(step, "create claim template: %v", err)
	}
	held, claim := heldGPUPod(ctx, t, c, steps, step, ns, "held", "held-gpu", nodeName)
	step = "a pod holds a " + migProfile + " partition before the upgrade"
	if _, err := client.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, migTemplate(ns, "held-1g", migProfile), metav1.CreateOptions{}); err != nil {
		steps.fail(step, "create claim template: %v", err)
	}
	heldMIG := withClaim(busyboxPod(ns, "held-mig", nodeName, "ls /dev/nvidia-caps"), "mig", "held-1g")
	heldMIG, _ = steps.run(ctx, c, step, heldMIG)
	migClaim := c.claimOf(ctx, t, heldMIG, "mig")
	if got := fakeInstances(steps, step, n.Node.Node); sum(got) != 1 {
		steps.fail(step, "the node's GPUs hold instances %v, want the held partition's one", got)
	}

	step = "helm upgrade to a new image tag replaces the plugin pod, the new one ready beside the old"
	t0 := time.Now()
	overlap := watchPluginOverlap(ctx, t, client, helm.DefaultRelease.Namespace, nodeName, old.UID)
	upgraded := maps.Clone(values)
	upgraded["image"] = chartnode.ImageValues(upgradeImage)
	if err := release.Upgrade(ctx, helm.DefaultRelease.Name, upgraded); err != nil {
		steps.fail(step, "%v", err)
	}
	// A pod created as the plugin is replaced: the old plugin prepares it
	// if it still can, else the kubelet retries until the new one serves.
	during := withClaim(busyboxPod(ns, "during", nodeName, "ls /dev/nvidia[0-9]*"), "gpu", "held-gpu")
	if _, err := client.CoreV1().Pods(ns).Create(ctx, during, metav1.CreateOptions{}); err != nil {
		steps.fail(step, "create pod %s: %v", during.Name, err)
	}
	plugin := waitForPluginPod(ctx, steps, client, helm.DefaultRelease.Namespace, nodeName, upgradeImage, old.UID, step)
	if _, err := os.Stat(filepath.Join(n.RegistrarDir(), driverName+"-"+string(plugin.UID)+"-reg.sock")); err != nil {
		steps.fail(step, "no registration socket of the new plugin pod %s: %v", plugin.Name, err)
	}
	if seen := overlap(); seen != "" {
		steps.fail(step, "the new plugin pod was never ready while the old one ran: %s", seen)
	}
	t.Logf("%s: %v", step, time.Since(t0).Round(time.Millisecond))

	step = "the held pods keep their GPU and partition through the upgrade"
	for _, pc := range []struct {
		pod   *corev1.Pod
		claim *resourceapi.ResourceClaim
	}{{held, claim}, {heldMIG, migClaim}} {
		p, err := client.CoreV1().Pods(ns).Get(ctx, pc.pod.Name, metav1.GetOptions{})
		if err != nil || p.Status.Phase != corev1.PodRunning || len(p.Status.ContainerStatuses) != 1 || p.Status.ContainerStatuses[0].RestartCount != 0 || p.UID != pc.pod.UID {
			steps.fail(step, "pod %s after the upgrade: %v %+v", pc.pod.Name, err, p)
		}
		if data := nodeCheckpoint(steps, step, n.Node.Node); data.Claims[string(pc.claim.UID)].Name != pc.claim.Name {
			steps.fail(step, "the checkpoint lost claim %s (uid %s) across the upgrade: it holds %v", pc.claim.Name, pc.claim.UID, slices.Collect(maps.Keys(data.Claims)))
		}
		if _, err := os.Stat(n.cdiSpecPath(t, pc.claim)); err != nil {
			steps.fail(step, "the CDI spec of claim %s is gone after the upgrade: %v", pc.claim.Name, err)
		}
	}
	if got := fakeInstances(steps, step, n.Node.Node); sum(got) != 1 {
		steps.fail(step, "after the upgrade the node's GPUs hold instances %v, want the held partition's one", got)
	}

	step = "the pod created during the upgrade runs once the new plugin is up"
	t0 = time.Now()
	during, _ = steps.wait(ctx, c, step, during)
	t.Logf("%s: %v", step, time.Since(t0).Round(time.Millisecond))

	step = "the controller and the webhook run the new image too"
	t0 = time.Now()
	checkControllerPod(ctx, steps, c.Cluster, helm.DefaultRelease.Namespace, upgradeImage)
	waitForComponentPod(ctx, steps, c.Cluster, helm.DefaultRelease.Namespace, "webhook", upgradeImage)
	checkWebhookPod(ctx, steps, c.Cluster, helm.DefaultRelease.Namespace, ns)
	t.Logf("%s: %v", step, time.Since(t0).Round(time.Millisecond))

	step = "the new plugin unprepares the claim the old one prepared"
	t0 = time.Now()
	c.deletePodsAndWait(ctx, t, held, heldMIG, during)
	waitNoCDISpecs(ctx, t, n)
	if data := nodeCheckpoint(steps, step, n.Node.Node); len(data.Claims) != 0 {
		steps.fail(step, "the checkpoint still holds claims %v after their pods were deleted", slices.Collect(maps.Keys(data.Claims)))
	}
	if got := fakeInstances(steps, step, n.Node.Node); sum(got) != 0 {
		steps.fail(step, "the partition the old plugin created was not destroyed: the node's GPUs hold instances %v", got)
	}
	t.Logf("%s: %v", step, time.Since(t0).Round(time.Millisecond))
	return plugin
}

// checkPluginPodReplaced deletes the plugin pod: the DaemonSet starts
// another, which registers and serves a new claim.
func checkPluginPodReplaced(ctx context.Context, t *testing.T, c *tesseraCluster, steps realNodeSteps, old *corev1.Pod, ns, nodeName string) *corev1.Pod {
	t.Helper()
	step := "a deleted plugin pod is replaced, and the new one serves claims"
	t0 := time.Now()
	client := c.Client()
	if err := client.CoreV1().Pods(old.Namespace).Delete(ctx, old.Name, metav1.DeleteOptions{}); err != nil {
		steps.fail(step, "delete plugin pod %s: %v", old.Name, err)
	}
	image := old.Status.ContainerStatuses[0].Image
	plugin := waitForPluginPod(ctx, steps, client, old.Namespace, nodeName, image, old.UID, step)
	pod, _ := heldGPUPod(ctx, t, c, steps, step, ns, "after-delete", "held-gpu", nodeName)
	c.deletePodsAndWait(ctx, t, pod)
	waitNoCDISpecs(ctx, t, c.nodes[nodeName])
	t.Logf("%s: %v", step, time.Since(t0).Round(time.Millisecond))
	return plugin
}

// checkDrain drains the node as kubectl drain does: it cordons the node
// and evicts every pod but the DaemonSet's through the Eviction API. The
// evicted GPU pod's claim is unprepared by the plugin, which stays; once the
// node is uncordoned, a new GPU pod runs there.
func checkDrain(ctx context.Context, t *testing.T, c *tesseraCluster, steps realNodeSteps, plugin *corev1.Pod, ns, nodeName string) {
	t.Helper()
	step := "a node drain evicts the GPU pods, their claims are unprepared and the plugin stays"
	t0 := time.Now()
	client := c.Client()
	pod, _ := heldGPUPod(ctx, t, c, steps, step, ns, "before-drain", "held-gpu", nodeName)
	cordon := func(unschedulable bool) {
		patch := fmt.Appendf(nil, `{"spec":{"unschedulable":%t}}`, unschedulable)
		if _, err := client.CoreV1().Nodes().Patch(ctx, nodeName, types.StrategicMergePatchType, patch, metav1.PatchOptions{}); err != nil {
			steps.fail(step, "set node %s unschedulable=%t: %v", nodeName, unschedulable, err)
		}
	}
	cordon(true)
	eviction := &policyv1.Eviction{ObjectMeta: metav1.ObjectMeta{Name: pod.Name, Namespace: pod.Namespace}}
	if err := client.PolicyV1().Evictions(pod.Namespace).Evict(ctx, eviction); err != nil {
		steps.fail(step, "evict pod %s: %v", pod.Name, err)
	}
	if err := waitPodGone(ctx, client, pod.Namespace, pod.Name); err != nil {
		steps.fail(step, "the evicted pod %s is still there: %v", pod.Name, err)
	}
	waitNoCDISpecs(ctx, t, c.nodes[nodeName])
	if data := nodeCheckpoint(steps, step, c.nodes[nodeName].Node.Node); len(data.Claims) != 0 {
		steps.fail(step, "the checkpoint still holds claims %v after the drain", slices.Collect(maps.Keys(data.Claims)))
	}
	if p, last := chartnode.PluginPod(ctx, client, plugin.Namespace, nodeName, plugin.Status.ContainerStatuses[0].Image, ""); p == nil || p.UID != plugin.UID {
		steps.fail(step, "the plugin pod %s did not stay through the drain: %s", plugin.Name, last)
	}
	cordon(false)
	after, _ := heldGPUPod(ctx, t, c, steps, step, ns, "after-drain", "held-gpu", nodeName)
	c.deletePodsAndWait(ctx, t, after)
	waitNoCDISpecs(ctx, t, c.nodes[nodeName])
	t.Logf("%s: %v", step, time.Since(t0).Round(time.Millisecond))
}

// fakeInstances reads, on a real-runtime node, how many MIG instances each
// GPU of the chart's simulated node holds: the fake driver's state, which
// outlives the plugin's pods as a real driver's does.
func fakeInstances(steps realNodeSteps, step string, node *cluster.Node) []int {
	steps.t.Helper()
	data, err := node.ReadFile(filepath.Join(cluster.NodeKubeletDir, "plugins", driverName, "fake-node", fakenode.StateFile))
	if err != nil {
		steps.fail(step, "read the simulated driver's state on node %s: %v", node.Name(), err)
	}
	counts, err := fakenode.GPUInstancesInState(data)
	if err != nil {
		steps.fail(step, "%v", err)
	}
	return counts
}

func sum(v []int) int {
	total := 0
	for _, x := range v {
		total += x
	}
	return total
}

// nodeCheckpoint reads the plugin's checkpoint on a real-runtime node.
func nodeCheckpoint(steps realNodeSteps, step string, node *cluster.Node) checkpoint.Data {
	steps.t.Helper()
	data, err := node.ReadFile(filepath.Join(cluster.NodeKubeletDir, "plugins", driverName, checkpoint.FileName))
	if err != nil {
		steps.fail(step, "read the plugin's checkpoint on node %s: %v", node.Name(), err)
	}
	dir := steps.t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, checkpoint.FileName), data, 0o600); err != nil {
		steps.t.Fatal(err)
	}
	store, err := checkpoint.NewStore(dir)
	if err != nil {
		steps.t.Fatal(err)
	}
	held, err := store.Load()
	if err != nil {
		steps.fail(step, "load the plugin's checkpoint on node %s: %v", node.Name(), err)
	}
	return held
}

// checkSliceWriter checks in the API server's audit log that the node's
// slices were created by the plugin's service account with the token the
// kubelet projected into pod: bound to the node and to the pod.
func checkSliceWriter(steps realNodeSteps, step string, c *cluster.Cluster, pod *corev1.Pod, node string) {
	steps.t.Helper()
	events, err := c.AuditEvents()
	if err != nil {
		steps.fail(step, "%v", err)
	}
	user := "system:serviceaccount:" + rbac.Namespace + ":" + rbac.KubeletPluginAccount
	var writes []string
	for _, e := range events {
		if e.Stage != "ResponseComplete" || e.ObjectRef == nil || e.ObjectRef.Resource != "resourceslices" || e.Verb != "create" {
			continue
		}
		writes = append(writes, fmt.Sprintf("%s by %s %v: %v", e.ObjectRef.Name, e.User.Username, e.User.Extra, e.ResponseStatus))
		if e.User.Username == user && e.ResponseStatus != nil && e.ResponseStatus.Code == 201 &&
			slices.Equal(e.User.Extra["authentication.kubernetes.io/node-name"], []string{node}) &&
			slices.Equal(e.User.Extra["authentication.kubernetes.io/pod-uid"], []string{string(pod.UID)}) {
			return
		}
	}
	steps.fail(step, "no slice created by %s with a token bound to node %s and pod %s; slice creations audited:\n%s",
		user, node, pod.UID, strings.Join(writes, "\n"))
}

// projectedToken reads the service-account token the kubelet projected into
// pod, in the node's mount namespace.
func projectedToken(steps realNodeSteps, step string, node *cluster.Node, pod *corev1.Pod) string {
	steps.t.Helper()
	pattern := filepath.Join(cluster.NodeKubeletDir, "pods", string(pod.UID), "volumes", "kubernetes.io~projected", "kube-api-access-*", "token")
	paths, err := node.Glob(pattern)
	if err != nil || len(paths) != 1 {
		steps.fail(step, "the projected token of pod %s: %v, %v", pod.Name, paths, err)
	}
	data, err := node.ReadFile(paths[0])
	if err != nil {
		steps.fail(step, "%v", err)
	}
	return string(data)
}

// bearerClient is an API client with token and no other credential.
func bearerClient(t *testing.T, admin *rest.Config, token string) kubernetes.Interface {
	t.Helper()
	cfg := rest.AnonymousClientConfig(admin)
	cfg.BearerToken = token
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return client
}

// checkUninstalled checks what helm uninstall leaves on node: no plugin pod,
// no MPS daemon pod, no registration socket, no ResourceSlice of the driver (the kubelet
// deletes the node's once the plugin has been gone for its grace period;
// the controller's domain pools go with the chart too), no CDI spec of
// Tessera's, and a checkpoint that holds no claim.
func checkUninstalled(ctx context.Context, steps realNodeSteps, step string, c *cluster.Cluster, node *cluster.Node, nodeName string) {
	steps.t.Helper()
	var last string
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		// A call cut short by the end of the wait keeps the last answer.
		pods, err := c.Client().CoreV1().Pods(helm.DefaultRelease.Namespace).List(ctx, metav1.ListOptions{LabelSelector: chartnode.PluginSelector})
		if err != nil {
			return false, nil
		}
		published, err := c.Client().ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: "spec.driver=" + driverName})
		if err != nil {
			return false, nil
		}
		var pools []string
		for _, s := range published.Items {
			pools = append(pools, s.Spec.Pool.Name)
		}
		daemons, err := c.Client().CoreV1().Pods(helm.DefaultRelease.Namespace).List(ctx, metav1.ListOptions{LabelSelector: mps.LabelApp + "=" + mps.AppName})
		if err != nil {
			return false, nil
		}
		sockets, _ := filepath.Glob(filepath.Join(node.RegistrarDir(), driverName+"-*"))
		last = fmt.Sprintf("%d plugin pods, %d MPS daemon pods, slices of pools %v, registration sockets %v", len(pods.Items), len(daemons.Items), pools, sockets)
		return len(pods.Items) == 0 && len(daemons.Items) == 0 && len(published.Items) == 0 && len(sockets) == 0, nil
	})
	if err != nil {
		steps.fail(step, "after helm uninstall: %s (%v)", last, err)
	}
	specs, _ := filepath.Glob(filepath.Join(node.CDIDir(), driverName+"-*"))
	if len(specs) != 0 {
		steps.fail(step, "after helm uninstall, Tessera's CDI specs %v stay on node %s", specs, nodeName)
	}
	if held := nodeCheckpoint(steps, step, node); len(held.Claims) != 0 {
		steps.fail(step, "after helm uninstall, the plugin's checkpoint on node %s holds claims %v", nodeName, slices.Collect(maps.Keys(held.Claims)))
	}
	if got := fakeInstances(steps, step, node); sum(got) != 0 {
		steps.fail(step, "after helm uninstall, the node's GPUs hold MIG instances %v", got)
	}
}
