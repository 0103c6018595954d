package e2e

import (
	"context"
	"fmt"
	"os"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/ptr"

	"github.com/tessera-dev/tessera/cdi"
	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/fakenode"
	"github.com/tessera-dev/tessera/driver/plugin"
	"github.com/tessera-dev/tessera/test/cluster"
	"github.com/tessera-dev/tessera/test/gpunode"
)

// This file runs Tessera's real kubelet plugin in-process, one per cluster
// node, each on its own simulated GPU node that the test keeps to observe
// NVML state (test/gpunode), and holds the checks the tests share.

const (
	gpuClass = gpunode.DriverName
	migClass = "mig.gpu.tessera.dev"
	// pause is the image of every test container; the fake runtime pulls
	// nothing.
	pause = "registry.k8s.io/pause:3.10"
)

// gpuNodeSpec is a cluster node and the fakenode profile it simulates.
type gpuNodeSpec struct {
	name, profile string
	// clique, if set, puts the node's GPUs in this multi-node NVLink
	// clique ("<clusterUUID>.<cliqueID>"); labels are the Node's labels.
	clique string
	labels map[string]string
	// options, if set, changes the node's plugin flags (e.g. shared GPUs).
	options func(*plugin.Options)
	// runtime is the node's container runtime (the fake one by default).
	runtime cluster.Runtime
}

// tesseraCluster is a local cluster with Tessera's DeviceClasses and RBAC
// installed and the plugin running on every node.
type tesseraCluster struct {
	*cluster.Cluster
	nodes map[string]*gpuNode
}

// gpuNode is one cluster node with its simulated GPUs and plugin.
type gpuNode struct {
	*gpunode.Node
}

// startTessera starts a cluster with the given GPU nodes and Tessera on each,
// and waits until every node's devices are published. Everything is stopped
// in t.Cleanup; the cluster's log tails are printed if t failed.
func startTessera(t *testing.T, specs ...gpuNodeSpec) *tesseraCluster {
	t.Helper()
	return startTesseraWith(t, cluster.Options{}, specs...)
}

// startTesseraWith is startTessera on a cluster of opts (its Nodes are
// specs').
func startTesseraWith(t *testing.T, opts cluster.Options, specs ...gpuNodeSpec) *tesseraCluster {
	t.Helper()
	for _, s := range specs {
		opts.Nodes = append(opts.Nodes, cluster.NodeSpec{Name: s.name, Labels: s.labels, Runtime: s.runtime})
	}
	c := cluster.StartT(t, opts)
	_, ctx := ktesting.NewTestContext(t)
	ctx, cancel := context.WithCancel(ctx)
	// Registered after StartT's cleanup, so it runs first: the plugins stop
	// before the cluster does.
	t.Cleanup(cancel)

	setupCtx, setupCancel := context.WithTimeout(ctx, time.Minute)
	defer setupCancel()
	if err := gpunode.Install(setupCtx, c); err != nil {
		t.Fatal(err)
	}
	client, err := gpunode.PluginClient(setupCtx, c)
	if err != nil {
		t.Fatal(err)
	}
	tc := &tesseraCluster{Cluster: c, nodes: map[string]*gpuNode{}}
	for _, s := range specs {
		n, err := gpunode.NewWith(ctx, c.Node(s.name), s.profile, t.TempDir(), client, fakenode.Options{Clique: s.clique})
		if err != nil {
			t.Fatal(err)
		}
		if s.options != nil {
			s.options(&n.Options)
			if err := n.Options.Validate(); err != nil {
				t.Fatal(err)
			}
		}
		tc.nodes[s.name] = &gpuNode{n}
		t.Cleanup(n.StopPlugin)
		if err := n.StartPlugin(); err != nil {
			t.Fatal(err)
		}
	}
	for _, n := range tc.nodes {
		if _, err := gpunode.WaitForSlices(setupCtx, c.Client(), n.Name(), time.Minute); err != nil {
			t.Fatal(err)
		}
	}
	return tc
}

// gpu is what the fake node's NVML says about one GPU.
type gpu struct {
	index int
	minor int
	uuid  string
}

// gpuOf returns the NVML facts of device gpu-<index>.
func (n *gpuNode) gpuOf(t testing.TB, device string) gpu {
	t.Helper()
	var index int
	if _, err := fmt.Sscanf(device, "gpu-%d", &index); err != nil {
		t.Fatalf("node %s: device %q is not a whole GPU (gpu-<index>)", n.Name(), device)
	}
	d, ret := n.Fake.NVML.DeviceGetHandleByIndex(index)
	if ret != nvml.SUCCESS {
		t.Fatalf("node %s: NVML has no GPU %d: %v", n.Name(), index, ret)
	}
	minor, ret := d.GetMinorNumber()
	if ret != nvml.SUCCESS {
		t.Fatalf("node %s: GPU %d minor: %v", n.Name(), index, ret)
	}
	uuid, ret := d.GetUUID()
	if ret != nvml.SUCCESS {
		t.Fatalf("node %s: GPU %d UUID: %v", n.Name(), index, ret)
	}
	return gpu{index: index, minor: minor, uuid: uuid}
}

// gpuCount is how many GPUs the node's NVML reports.
func (n *gpuNode) gpuCount(t testing.TB) int {
	t.Helper()
	count, ret := n.Fake.NVML.DeviceGetCount()
	if ret != nvml.SUCCESS {
		t.Fatalf("node %s: NVML device count: %v", n.Name(), ret)
	}
	return count
}

// cdiSpecs lists the CDI spec files of the node's CDI dir.
func (n *gpuNode) cdiSpecs() []string {
	entries, _ := os.ReadDir(n.CDIDir())
	var out []string
	for _, e := range entries {
		out = append(out, e.Name())
	}
	return out
}

// cdiSpecPath is where the plugin writes the CDI spec of a claim.
func (n *gpuNode) cdiSpecPath(t testing.TB, claim *resourceapi.ResourceClaim) string {
	t.Helper()
	store, err := cdi.NewStore(n.CDIDir())
	if err != nil {
		t.Fatal(err)
	}
	return store.Path(string(claim.UID))
}

// newGPUPod is a pause pod whose container uses the pod's claims. Its grace
// period is one second, not zero: the API server removes a pod with none at
// once, and a kubelet that never saw the pod terminating leaves its claims
// to the DRA manager's 60 s reconcile instead of unpreparing them at once.
func newGPUPod(ns, name string, claims ...corev1.PodResourceClaim) *corev1.Pod {
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: corev1.PodSpec{
			Containers:                    []corev1.Container{{Name: "main", Image: pause}},
			TerminationGracePeriodSeconds: ptr.To[int64](1),
			ResourceClaims:                claims,
		},
	}
	for _, c := range claims {
		pod.Spec.Containers[0].Resources.Claims = append(pod.Spec.Containers[0].Resources.Claims, corev1.ResourceClaim{Name: c.Name})
	}
	return pod
}

// onNode pins a pod to a node through the scheduler (node affinity), so
// that its claims are still allocated by the scheduler.
func onNode(pod *corev1.Pod, node string) *corev1.Pod {
	return onNodes(pod, node)
}

// gpuTemplate is a claim template for count whole GPUs.
func gpuTemplate(ns, name string, count int64) *resourceapi.ResourceClaimTemplate {
	return &resourceapi.ResourceClaimTemplate{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: resourceapi.ResourceClaimTemplateSpec{Spec: resourceapi.ResourceClaimSpec{
			Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
				Name:    "gpus",
				Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: gpuClass, Count: count},
			}}},
		}},
	}
}

// migTemplate is a template for one MIG partition of the profile.
func migTemplate(ns, name, profile string) *resourceapi.ResourceClaimTemplate {
	return &resourceapi.ResourceClaimTemplate{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: resourceapi.ResourceClaimTemplateSpec{Spec: resourceapi.ResourceClaimSpec{
			Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
				Name: "mig",
				Exactly: &resourceapi.ExactDeviceRequest{
					DeviceClassName: migClass,
					Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{
						Expression: fmt.Sprintf(`device.attributes["gpu.tessera.dev"].profile == %q`, profile),
					}}},
				},
			}}},
		}},
	}
}

// createAndRun creates the pod and waits until it runs; it returns the
// running pod.
func (c *tesseraCluster) createAndRun(ctx context.Context, t testing.TB, pod *corev1.Pod) *corev1.Pod {
	t.Helper()
	if _, err := c.Client().CoreV1().Pods(pod.Namespace).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create pod %s/%s: %v", pod.Namespace, pod.Name, err)
	}
	return c.waitRunning(ctx, t, pod.Namespace, pod.Name)
}

func (c *tesseraCluster) waitRunning(ctx context.Context, t testing.TB, ns, name string) *corev1.Pod {
	t.Helper()
	return c.waitForPod(ctx, t, ns, name, "Running", 90*time.Second, func(p *corev1.Pod) bool {
		return p.Status.Phase == corev1.PodRunning
	})
}

// waitForPod polls the pod until done accepts it; on timeout the test fails
// with the pod's last status and events.
func (c *tesseraCluster) waitForPod(ctx context.Context, t testing.TB, ns, name, what string, timeout time.Duration, done func(*corev1.Pod) bool) *corev1.Pod {
	t.Helper()
	return pollPod(ctx, t, c.Client(), ns, name, what, timeout, done, func() string { return "events:\n" + c.events(ctx, ns) })
}

// events formats a namespace's events, for failure messages.
func (c *tesseraCluster) events(ctx context.Context, ns string) string {
	list, err := c.Client().CoreV1().Events(ns).List(context.WithoutCancel(ctx), metav1.ListOptions{})
	if err != nil {
		return fmt.Sprintf("(list events: %v)", err)
	}
	var b strings.Builder
	for _, e := range list.Items {
		fmt.Fprintf(&b, "  %s %s/%s %s: %s\n", e.Type, e.InvolvedObject.Kind, e.InvolvedObject.Name, e.Reason, e.Message)
	}
	return b.String()
}

// claimOf returns the allocated claim behind a running pod's pod claim.
func (c *tesseraCluster) claimOf(ctx context.Context, t testing.TB, pod *corev1.Pod, podClaim string) *resourceapi.ResourceClaim {
	t.Helper()
	var name string
	for _, s := range pod.Status.ResourceClaimStatuses {
		if s.Name == podClaim && s.ResourceClaimName != nil {
			name = *s.ResourceClaimName
		}
	}
	for _, pc := range pod.Spec.ResourceClaims {
		if pc.Name == podClaim && pc.ResourceClaimName != nil {
			name = *pc.ResourceClaimName
		}
	}
	if name == "" {
		t.Fatalf("pod %s/%s: no ResourceClaim for pod claim %q (status %+v)", pod.Namespace, pod.Name, podClaim, pod.Status.ResourceClaimStatuses)
	}
	claim, err := c.Client().ResourceV1().ResourceClaims(pod.Namespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("get claim %s/%s: %v", pod.Namespace, name, err)
	}
	if claim.Status.Allocation == nil {
		t.Fatalf("claim %s/%s of running pod %s is not allocated", pod.Namespace, name, pod.Name)
	}
	return claim
}

// containerOf returns what the runtime recorded for the pod's container.
func (c *tesseraCluster) containerOf(t testing.TB, pod *corev1.Pod) cluster.RecordedContainer {
	t.Helper()
	node := c.Node(pod.Spec.NodeName)
	if node == nil {
		t.Fatalf("pod %s/%s runs on unknown node %q", pod.Namespace, pod.Name, pod.Spec.NodeName)
	}
	var found []cluster.RecordedContainer
	for _, rc := range node.Containers() {
		if rc.PodUID == string(pod.UID) && rc.Name == "main" {
			found = append(found, rc)
		}
	}
	if len(found) != 1 {
		t.Fatalf("pod %s/%s: runtime of %s recorded %d containers named main, want 1", pod.Namespace, pod.Name, node.Name(), len(found))
	}
	return found[0]
}

var (
	gpuNodeRE = regexp.MustCompile(`^/dev/nvidia[0-9]+$`)
	capNodeRE = regexp.MustCompile(`^/dev/nvidia-caps/nvidia-cap[0-9]+$`)
)

// controlNodes are the device nodes every CUDA container gets beside its
// GPUs (fake nodes load nvidia-uvm).
var controlNodes = []string{"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}

// driverMounts are where one of the driver files every GPU container gets
// lies: the host's library directory, x86_64 on DGX systems and aarch64 on
// GB200 trays.
var driverMounts = []string{"/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1", "/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.1"}

// deviceNodes returns the container's device node paths matching re.
func deviceNodes(rc cluster.RecordedContainer, re *regexp.Regexp) []string {
	var out []string
	for _, d := range rc.Spec.Linux.Devices {
		if re == nil || re.MatchString(d.Path) {
			out = append(out, d.Path)
		}
	}
	sort.Strings(out)
	return out
}

// checkGPUContainer checks that the container received exactly the given
// GPUs of the node (device nodes and NVIDIA_VISIBLE_DEVICES), the control
// nodes and the driver files.
func checkGPUContainer(t testing.TB, n *gpuNode, rc cluster.RecordedContainer, devices []string) {
	t.Helper()
	var wantNodes, wantUUIDs []string
	for _, d := range devices {
		g := n.gpuOf(t, d)
		wantNodes = append(wantNodes, fmt.Sprintf("/dev/nvidia%d", g.minor))
		wantUUIDs = append(wantUUIDs, g.uuid)
	}
	sort.Strings(wantNodes)
	sort.Strings(wantUUIDs)
	if got := deviceNodes(rc, gpuNodeRE); !slices.Equal(got, wantNodes) {
		t.Errorf("container of pod %s got GPU device nodes %v, want %v (devices %s)", rc.PodName, got, wantNodes, devices)
	}
	checkCommon(t, rc)
	visible := strings.Split(rc.EnvMap()["NVIDIA_VISIBLE_DEVICES"], ",")
	sort.Strings(visible)
	if !slices.Equal(visible, wantUUIDs) {
		t.Errorf("container of pod %s got NVIDIA_VISIBLE_DEVICES=%v, want %v", rc.PodName, visible, wantUUIDs)
	}
}

// checkCommon checks the control nodes and the driver files.
func checkCommon(t testing.TB, rc cluster.RecordedContainer) {
	t.Helper()
	all := deviceNodes(rc, nil)
	for _, want := range controlNodes {
		if !slices.Contains(all, want) {
			t.Errorf("container of pod %s lacks control node %s; it has %v", rc.PodName, want, all)
		}
	}
	if !slices.ContainsFunc(rc.Spec.Mounts, func(m specs.Mount) bool { return slices.Contains(driverMounts, m.Destination) }) {
		var mounts []string
		for _, m := range rc.Spec.Mounts {
			mounts = append(mounts, m.Destination)
		}
		t.Errorf("container of pod %s lacks the driver mount (one of %v); mounts: %v", rc.PodName, driverMounts, mounts)
	}
}

// allocatedDevices lists a claim's allocated device names.
func allocatedDevices(claim *resourceapi.ResourceClaim) []string {
	var out []string
	for _, r := range claim.Status.Allocation.Devices.Results {
		out = append(out, r.Device)
	}
	sort.Strings(out)
	return out
}

// deletePodsAndWait deletes the pods and waits until they are gone and the
// node's CDI dir holds no spec of their claims any more.
func (c *tesseraCluster) deletePodsAndWait(ctx context.Context, t testing.TB, pods ...*corev1.Pod) {
	t.Helper()
	for _, p := range pods {
		err := c.Client().CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			t.Fatalf("delete pod %s/%s: %v", p.Namespace, p.Name, err)
		}
	}
	for _, p := range pods {
		if err := waitPodGone(ctx, c.Client(), p.Namespace, p.Name); err != nil {
			t.Fatalf("pod %s/%s not gone after deletion: %v", p.Namespace, p.Name, err)
		}
	}
}

// waitNoCDISpecs waits until the node's CDI dir holds no claim spec.
func waitNoCDISpecs(ctx context.Context, t testing.TB, n *gpuNode) {
	t.Helper()
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		return len(n.cdiSpecs()) == 0, nil
	})
	if err != nil {
		t.Fatalf("node %s: CDI specs %v still there: claims not unprepared: %v", n.Name(), n.cdiSpecs(), err)
	}
}

// createTemplates creates ResourceClaimTemplates, each in its namespace.
func (c *tesseraCluster) createTemplates(ctx context.Context, t testing.TB, tmpls ...*resourceapi.ResourceClaimTemplate) {
	t.Helper()
	for _, tmpl := range tmpls {
		if _, err := c.Client().ResourceV1().ResourceClaimTemplates(tmpl.Namespace).Create(ctx, tmpl, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create ResourceClaimTemplate %s/%s: %v", tmpl.Namespace, tmpl.Name, err)
		}
	}
}

// gpuFrom is a pod's claim "gpu", made from the named template.
func gpuFrom(template string) corev1.PodResourceClaim {
	return corev1.PodResourceClaim{Name: "gpu", ResourceClaimTemplateName: ptr.To(template)}
}

// waitCheckpointEmpty waits until the node's checkpoint holds no claim: an
// unprepare removes the CDI spec before its claim leaves the checkpoint, so
// a spec gone does not mean the checkpoint is written yet.
func waitCheckpointEmpty(ctx context.Context, t testing.TB, n *gpuNode) {
	t.Helper()
	store, err := checkpoint.NewStore(n.Options.PluginDataDir)
	if err != nil {
		t.Fatal(err)
	}
	var data checkpoint.Data
	err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		data, err = store.Load()
		return err == nil && len(data.Claims) == 0, nil
	})
	if err != nil {
		t.Errorf("node %s: checkpoint still holds claims %+v (load error %v)", n.Name(), data.Claims, err)
	}
}

// newNamespace creates a namespace for one test and, in t.Cleanup, deletes
// its pods and claims and waits until they are gone, so that the next test
// on a shared cluster finds every GPU free.
func (c *tesseraCluster) newNamespace(ctx context.Context, t testing.TB, ns string) {
	t.Helper()
	if err := c.CreateNamespace(ctx, ns); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 90*time.Second)
		defer cancel()
		client := c.Client()
		if err := client.CoreV1().Pods(ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{}); err != nil {
			t.Errorf("clean up namespace %s: delete pods: %v", ns, err)
			return
		}
		if err := client.ResourceV1().ResourceClaims(ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{}); err != nil {
			t.Errorf("clean up namespace %s: delete claims: %v", ns, err)
			return
		}
		err := wait.PollUntilContextCancel(ctx, 200*time.Millisecond, true, func(ctx context.Context) (bool, error) {
			pods, err := client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
			if err != nil {
				return false, nil
			}
			claims, err := client.ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
			return err == nil && len(pods.Items) == 0 && len(claims.Items) == 0, nil
		})
		if err != nil {
			t.Errorf("clean up namespace %s: pods or claims still there: %v", ns, err)
		}
	})
}

// eventually polls cond until it holds; the test fails after timeout.
func eventually(ctx context.Context, t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, timeout, true, func(context.Context) (bool, error) {
		return cond(), nil
	})
	if err != nil {
		t.Fatalf("not %s within %v: %v", what, timeout, err)
	}
}

// waitPodGone waits (a minute at most) until pod ns/name no longer exists.
func waitPodGone(ctx context.Context, client kubernetes.Interface, ns, name string) error {
	return wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		_, err := client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	})
}
