package e2e

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/ptr"

	"github.com/tessera-dev/tessera/test/cluster"
)

const stubManifests = `
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: stub-plugin
rules:
- apiGroups: ["resource.k8s.io"]
  resources: ["resourceslices"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"]
- apiGroups: ["resource.k8s.io"]
  resources: ["resourceclaims"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["get", "list", "watch"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: stub-plugin
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: stub-plugin
subjects:
- kind: ServiceAccount
  name: stub-plugin
  namespace: stub-system
---
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata:
  name: stub.tessera.dev
spec:
  selectors:
  - cel:
      expression: device.driver == "stub.tessera.dev"
`

// TestHarnessPreparesClaimAndInjectsCDIThroughRealKubelet checks the
// harness's whole DRA path with a stand-in plugin running under its own
// service account: the kubelet registers the plugin, prepares the claim, and
// the runtime injects the plugin's CDI device into the container; after a
// kubelet restart the plugin serves a second pod, and deleting both pods
// unprepares both claims.
func TestHarnessPreparesClaimAndInjectsCDIThroughRealKubelet(t *testing.T) {
	t.Parallel()
	c := cluster.StartT(t, cluster.Options{Nodes: []cluster.NodeSpec{{Name: "node-a"}}})
	_, ctx := ktesting.NewTestContext(t)
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	node := c.Node("node-a")
	client := c.Client()

	if err := c.Apply(ctx, []byte(stubManifests)); err != nil {
		t.Fatal(err)
	}
	kubeconfig, err := c.ServiceAccountKubeconfig(ctx, "stub-system", "stub-plugin")
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	pluginClient, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	helper, err := startStubPlugin(ctx, node, pluginClient)
	if err != nil {
		t.Fatal(err)
	}
	defer helper.Stop()

	const ns = "harness"
	if err := c.CreateNamespace(ctx, ns); err != nil {
		t.Fatal(err)
	}
	template := &resourceapi.ResourceClaimTemplate{
		ObjectMeta: metav1.ObjectMeta{Name: "one-dev", Namespace: ns},
		Spec: resourceapi.ResourceClaimTemplateSpec{Spec: resourceapi.ResourceClaimSpec{
			Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
				Name: "dev", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: stubDriver},
			}}},
		}},
	}
	if _, err := client.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, template, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	first := runPodWithClaim(ctx, t, c, ns, "first", template.Name)

	before := stubSliceUIDs(ctx, t, client)
	start := time.Now()
	if err := node.RestartKubelet(ctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("kubelet restarted in %v", time.Since(start).Round(time.Millisecond))
	// A starting kubelet deletes all ResourceSlices of its node; the
	// plugin's slice controller (kubeletplugin's resourceslice controller,
	// sync delay 30s, not configurable through kubeletplugin) publishes them
	// again. Until then nothing new schedules onto the node.
	err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		for uid := range stubSliceUIDs(ctx, t, client) {
			if !before[uid] {
				return true, nil
			}
		}
		return false, nil
	})
	if err != nil {
		t.Fatalf("stub plugin's ResourceSlice not republished after the kubelet restart: %v", err)
	}
	t.Logf("slices republished %v after the restart began", time.Since(start).Round(time.Millisecond))
	// A pod that runs after the restart shows the kubelet found the plugin
	// again, and that it has seen the first pod: deleting a pod the kubelet
	// has not seen yet leaves its claim to the DRA manager's 60s reconcile.
	second := runPodWithClaim(ctx, t, c, ns, "second", template.Name)

	for _, pod := range []*corev1.Pod{first, second} {
		if err := client.CoreV1().Pods(ns).Delete(ctx, pod.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		specs, _ := filepath.Glob(filepath.Join(node.CDIDir(), stubDriver+"-*.json"))
		pods, err := client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		return err == nil && len(specs) == 0 && len(pods.Items) == 0, nil
	})
	if err != nil {
		entries, _ := os.ReadDir(node.CDIDir())
		t.Fatalf("pods not gone or claims not unprepared after deletion: %v (CDI dir: %v)", err, entries)
	}
}

func stubSliceUIDs(ctx context.Context, t *testing.T, client kubernetes.Interface) map[types.UID]bool {
	t.Helper()
	slices, err := client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: "spec.driver=" + stubDriver})
	if err != nil {
		t.Fatalf("list stub slices: %v", err)
	}
	uids := map[types.UID]bool{}
	for _, s := range slices.Items {
		uids[s.UID] = true
	}
	return uids
}

// runPodWithClaim runs a pod with a claim from the template and checks that
// the runtime got the stub plugin's CDI device.
func runPodWithClaim(ctx context.Context, t *testing.T, c *cluster.Cluster, ns, name, template string) *corev1.Pod {
	t.Helper()
	pod := newPod(name)
	pod.Namespace = ns
	pod.Spec.ResourceClaims = []corev1.PodResourceClaim{{Name: "dev", ResourceClaimTemplateName: ptr.To(template)}}
	pod.Spec.Containers[0].Resources.Claims = []corev1.ResourceClaim{{Name: "dev"}}
	if _, err := c.Client().CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pod = waitForPodIn(ctx, t, c, ns, pod.Name, "Running", func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodRunning })
	node := c.Node(pod.Spec.NodeName)
	i := slices.IndexFunc(node.Containers(), func(rc cluster.RecordedContainer) bool { return rc.PodUID == string(pod.UID) })
	if i < 0 {
		t.Fatalf("runtime recorded no container of pod %s: %+v", pod.Name, node.Containers())
	}
	rc := node.Containers()[i]
	if len(rc.CDIDevices) != 1 || filepath.Dir(rc.CDIDevices[0]) != stubDriver {
		t.Errorf("pod %s: container got CDI devices %v, want one of %s", name, rc.CDIDevices, stubDriver)
	}
	device := rc.EnvMap()["STUB_DEVICE"]
	if device != "dev-0" && device != "dev-1" {
		t.Errorf("pod %s: container env STUB_DEVICE = %q, want dev-0 or dev-1 (env %v)", name, device, rc.Spec.Process.Env)
	}
	if !slices.ContainsFunc(rc.Spec.Linux.Devices, func(d specs.LinuxDevice) bool { return d.Path == "/dev/stub-"+device }) {
		t.Errorf("pod %s: container device nodes %+v lack /dev/stub-%s", name, rc.Spec.Linux.Devices, device)
	}
	return pod
}
