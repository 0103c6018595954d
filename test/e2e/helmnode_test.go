package e2e

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/ptr"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/tessera-dev/tessera/deployments/helm"
	"github.com/tessera-dev/tessera/deployments/rbac"
	"github.com/tessera-dev/tessera/driver/fakenode"
	"github.com/tessera-dev/tessera/test/cluster"
	"github.com/tessera-dev/tessera/test/gpunode"
	"github.com/tessera-dev/tessera/test/ociimage"
)

// tesseraImage is the name Tessera's image, built by test/ociimage, has on
// real-runtime nodes.
const tesseraImage = "tessera.test/tessera:e2e"

// buildTesseraImage builds Tessera's binaries and image as `make image-oci`
// does and writes it to an OCI archive under dir.
func buildTesseraImage(ctx context.Context, t *testing.T, dir string) string {
	t.Helper()
	start := time.Now()
	bin := filepath.Join(dir, "bin")
	if err := ociimage.BuildBinaries(ctx, "../..", bin); err != nil {
		t.Fatalf("build Tessera's binaries for its image: %v", err)
	}
	img, err := ociimage.Tessera(ociimage.DebDir(), bin)
	if err != nil {
		t.Fatalf("assemble Tessera's image: %v", err)
	}
	archive := filepath.Join(dir, "tessera.oci.tar")
	if err := ociimage.WriteArchive(archive, map[string]v1.Image{tesseraImage: img}); err != nil {
		t.Fatalf("write Tessera's image: %v", err)
	}
	t.Logf("Tessera's image built in %v", time.Since(start).Round(time.Millisecond))
	return archive
}

// chartOnRealNodeValues are the chart's values that run the kubelet plugin
// from image tesseraImage on a real-runtime node, simulating profile. The
// kubelet and CDI dirs are the chart's defaults (a real-runtime node has
// them where a real node does); since the local cluster runs no Service
// proxy, the plugin runs in the node's network with the API server's
// loopback address in place of the kubernetes Service; its health and
// metrics ports are free ports of that network.
func chartOnRealNodeValues(t *testing.T, c *cluster.Cluster, profile string) map[string]any {
	t.Helper()
	api, err := url.Parse(c.RESTConfig().Host)
	if err != nil {
		t.Fatal(err)
	}
	ports, err := cluster.FreePorts(2)
	if err != nil {
		t.Fatal(err)
	}
	return map[string]any{
		"namespace": map[string]any{"create": true},
		"image":     map[string]any{"repository": strings.Split(tesseraImage, ":")[0], "tag": strings.Split(tesseraImage, ":")[1], "pullPolicy": "Never"},
		"kubeletPlugin": map[string]any{
			"fakeNode":    profile,
			"hostNetwork": true,
			"extraEnv": []any{
				map[string]any{"name": "KUBERNETES_SERVICE_HOST", "value": api.Hostname()},
				map[string]any{"name": "KUBERNETES_SERVICE_PORT", "value": api.Port()},
			},
			"healthPort":   ports[0],
			"metricsPort":  ports[1],
			"logVerbosity": 4,
		},
		"controller": map[string]any{"enabled": false},
	}
}

// TestHelmChartRunsThePluginOnARealRuntimeNode installs the Helm chart, as
// Helm 4 applies it, on a cluster with a real-runtime node (containerd,
// runc) that holds Tessera's image built without a container engine. The
// DaemonSet's pod runs the plugin from that image under runc, simulating a
// DGX H100 (kubeletPlugin.fakeNode); it registers with the kubelet through
// the registration directory mounted from the node, and publishes the node's
// ResourceSlices with the token the kubelet projected into it: the API
// server's audit log shows the write came from the plugin's service account
// with a token bound to the node and the pod. With that same token the
// node-lock policy refuses a slice of another node. A pod with a one-GPU
// claim then runs on the node under runc and sees its GPU's device nodes,
// environment and driver file, and only its GPU (gpuProbe).
func TestHelmChartRunsThePluginOnARealRuntimeNode(t *testing.T) {
	start := time.Now()
	_, ctx := ktesting.NewTestContext(t)
	ctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	archive := buildTesseraImage(ctx, t, t.TempDir())
	const nodeName, profile = "real-1", "dgx-h100"
	c := cluster.StartT(t, cluster.Options{Nodes: []cluster.NodeSpec{{
		Name: nodeName, Runtime: cluster.RealContainerd,
		Labels: map[string]string{"nvidia.com/gpu.present": "true"}, // the chart's default node selector
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

	step = "the chart is installed"
	t0 = time.Now()
	manifests, err := helm.Render(ctx, chartOnRealNodeValues(t, c, profile), helm.DefaultRelease)
	if err != nil {
		steps.fail(step, "render: %v", err)
	}
	a := newApplier(t, c.RESTConfig())
	created, _ := a.install(ctx, t, "real-node", manifests)
	t.Logf("%s: %d objects in %v", step, len(created), time.Since(t0).Round(time.Millisecond))

	step = "the DaemonSet's pod runs the plugin from Tessera's image under runc"
	t0 = time.Now()
	pluginPod = waitForPluginPod(ctx, steps, c.Client(), ns, nodeName, step)
	status := pluginPod.Status.ContainerStatuses[0]
	if status.Image != tesseraImage {
		steps.fail(step, "the plugin's container runs image %q, want %q", status.Image, tesseraImage)
	}
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
	checkGPUPod(ctx, t, tc, steps, "workloads", nodeName)
	t.Logf("test took %v", time.Since(start).Round(time.Millisecond))
}

// waitForPluginPod waits until the DaemonSet's pod on node runs.
func waitForPluginPod(ctx context.Context, steps realNodeSteps, client kubernetes.Interface, ns, node, step string) *corev1.Pod {
	steps.t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	var last string
	for time.Now().Before(deadline) {
		pods, err := client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{
			LabelSelector: "app.kubernetes.io/component=kubelet-plugin", FieldSelector: "spec.nodeName=" + node})
		if err != nil {
			last = err.Error()
		} else if len(pods.Items) != 1 {
			last = fmt.Sprintf("%d plugin pods on node %s", len(pods.Items), node)
		} else if p := &pods.Items[0]; p.Status.Phase != corev1.PodRunning || len(p.Status.ContainerStatuses) != 1 || !p.Status.ContainerStatuses[0].Ready {
			last = fmt.Sprintf("pod %s: %s %+v", p.Name, p.Status.Phase, p.Status.ContainerStatuses)
		} else {
			return p
		}
		time.Sleep(200 * time.Millisecond)
	}
	steps.fail(step, "no running plugin pod on node %s within 2m: %s", node, last)
	return nil
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
