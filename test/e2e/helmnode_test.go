package e2e

import (
	"context"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/ptr"

	"github.com/tessera-dev/tessera/deployments/helm"
	"github.com/tessera-dev/tessera/deployments/rbac"
	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/fakenode"
	"github.com/tessera-dev/tessera/test/chartnode"
	"github.com/tessera-dev/tessera/test/cluster"
	"github.com/tessera-dev/tessera/test/gpunode"
	"github.com/tessera-dev/tessera/test/helmrelease"
)

// tesseraImage is the name Tessera's image, built by test/ociimage, has on
// real-runtime nodes; upgradeImage is the same image under the tag a helm
// upgrade moves to.
const (
	tesseraImage = "tessera.test/tessera:e2e"
	upgradeImage = "tessera.test/tessera:e2e-upgrade"
)

// buildTesseraImage builds Tessera's image as `make image-oci` does and
// writes it to an OCI archive under dir, named tesseraImage and
// upgradeImage.
func buildTesseraImage(ctx context.Context, t *testing.T, dir string) string {
	t.Helper()
	start := time.Now()
	archive, err := chartnode.BuildImage(ctx, "../..", dir, tesseraImage, upgradeImage)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("Tessera's image built in %v", time.Since(start).Round(time.Millisecond))
	return archive
}

// TestHelmChartRunsThePluginOnARealRuntimeNode installs the Helm chart with
// helm (helm install --create-namespace) on a cluster with a real-runtime
// node (containerd, runc) that holds Tessera's image built without a
// container engine. The
// DaemonSet's pod runs the plugin from that image under runc, simulating a
// DGX H100 (kubeletPlugin.fakeNode); it registers with the kubelet through
// the registration directory mounted from the node, and publishes the node's
// ResourceSlices with the token the kubelet projected into it: the API
// server's audit log shows the write came from the plugin's service account
// with a token bound to the node and the pod. With that same token the
// node-lock policy refuses a slice of another node. A pod with a one-GPU
// claim then runs on the node under runc and sees its GPU's device nodes,
// environment and driver file, and only its GPU (gpuProbe); its image, a
// /usr/lib64 layout, finds libcuda.so.1 in the loader cache the chart's
// tessera-cdi-hook wrote (checkGPUPod). A pod with a 1g.10gb partition sees
// its parent GPU and exactly its partition's MIG capability nodes
// (checkMIGPod). Then the operator's life cycle: helm upgrade while pods
// hold a GPU and a partition (checkUpgradeKeepsHeldGPUs), a deleted plugin
// pod (checkPluginPodReplaced), a drain (checkDrain) and helm uninstall
// (checkUninstalled).
func TestHelmChartRunsThePluginOnARealRuntimeNode(t *testing.T) {
	start := time.Now()
	_, ctx := ktesting.NewTestContext(t)
	ctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	archive := buildTesseraImage(ctx, t, t.TempDir())
	const nodeName, profile = "real-1", "dgx-h100"
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
	checkGPUPod(ctx, t, tc, steps, "workloads", nodeName, true)
	checkMIGPod(ctx, t, tc, steps, "workloads", nodeName)
	pluginPod = checkUpgradeKeepsHeldGPUs(ctx, t, tc, steps, release, values, pluginPod, "workloads", nodeName)
	pluginPod = checkPluginPodReplaced(ctx, t, tc, steps, pluginPod, "workloads", nodeName)
	checkDrain(ctx, t, tc, steps, pluginPod, "workloads", nodeName)

	step = "helm uninstall removes the plugin; the node keeps no slice, CDI spec, prepared claim or MIG instance"
	t0 = time.Now()
	if err := release.Uninstall(ctx, helm.DefaultRelease.Name); err != nil {
		steps.fail(step, "%v", err)
	}
	checkUninstalled(ctx, steps, step, c, node, nodeName)
	t.Logf("%s: %v", step, time.Since(t0).Round(time.Millisecond))
	t.Logf("test took %v", time.Since(start).Round(time.Millisecond))
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
// pod holds a GPU and another a 1g.10gb partition: the DaemonSet replaces
// the plugin pod (in the host network the old one stops first, see the
// chart's update strategy), the held pods keep running with their claims'
// CDI specs and checkpoint entries and the partition, a
// pod created as the upgrade starts runs (the kubelet retries its prepare
// until a plugin serves it), and the new plugin unprepares the claim the
// old one prepared when its pod is deleted, destroying the partition the
// old one created. It returns the new plugin pod.
func checkUpgradeKeepsHeldGPUs(ctx context.Context, t *testing.T, c *tesseraCluster, steps realNodeSteps, release *helmrelease.Client, values map[string]any, old *corev1.Pod, ns, nodeName string) *corev1.Pod {
	t.Helper()
	n := c.nodes[nodeName]
	client := c.Client()
	step := "a pod holds a GPU before the upgrade"
	if _, err := client.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, gpuTemplate(ns, "held-gpu", 1), metav1.CreateOptions{}); err != nil {
		steps.fail(step, "create claim template: %v", err)
	}
	held, claim := heldGPUPod(ctx, t, c, steps, step, ns, "held", "held-gpu", nodeName)
	step = "a pod holds a 1g.10gb partition before the upgrade"
	if _, err := client.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, migTemplate(ns, "held-1g", "1g.10gb"), metav1.CreateOptions{}); err != nil {
		steps.fail(step, "create claim template: %v", err)
	}
	heldMIG := withClaim(busyboxPod(ns, "held-mig", nodeName, "ls /dev/nvidia-caps"), "mig", "held-1g")
	heldMIG, _ = steps.run(ctx, c, step, heldMIG)
	migClaim := c.claimOf(ctx, t, heldMIG, "mig")
	if got := fakeInstances(steps, step, n.Node.Node); sum(got) != 1 {
		steps.fail(step, "the node's GPUs hold instances %v, want the held partition's one", got)
	}

	step = "helm upgrade to a new image tag replaces the plugin pod"
	t0 := time.Now()
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
	if err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		_, err := client.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	}); err != nil {
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
// no registration socket, no ResourceSlice of the node (the kubelet deletes
// them once the plugin has been gone for its grace period), no CDI spec of
// Tessera's, and a checkpoint that holds no claim.
func checkUninstalled(ctx context.Context, steps realNodeSteps, step string, c *cluster.Cluster, node *cluster.Node, nodeName string) {
	steps.t.Helper()
	var last string
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		pods, err := c.Client().CoreV1().Pods(helm.DefaultRelease.Namespace).List(ctx, metav1.ListOptions{LabelSelector: chartnode.PluginSelector})
		if err != nil {
			last = err.Error()
			return false, nil
		}
		published, err := c.Client().ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + nodeName})
		if err != nil {
			last = err.Error()
			return false, nil
		}
		sockets, _ := filepath.Glob(filepath.Join(node.RegistrarDir(), driverName+"-*"))
		last = fmt.Sprintf("%d plugin pods, %d slices of node %s, registration sockets %v", len(pods.Items), len(published.Items), nodeName, sockets)
		return len(pods.Items) == 0 && len(published.Items) == 0 && len(sockets) == 0, nil
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
