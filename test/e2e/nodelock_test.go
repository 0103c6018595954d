package e2e

import (
	"context"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"github.com/tessera-dev/tessera/deployments/rbac"
	"github.com/tessera-dev/tessera/test/cluster"
)

// TestNodeLockedSliceWrites installs the plugin's RBAC and the chart's
// ValidatingAdmissionPolicy on the real API server and writes ResourceSlices
// with the plugin's service-account tokens: bound to node-a it may write
// node-a's slices and nothing of node-b's; unbound it may write none.
func TestNodeLockedSliceWrites(t *testing.T) {
	t.Parallel()
	c := cluster.StartT(t, cluster.Options{})
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	admin := c.Client()
	for _, n := range []string{"node-a", "node-b"} {
		if _, err := admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.Apply(ctx, rbac.KubeletPlugin); err != nil {
		t.Fatal(err)
	}
	if err := c.Apply(ctx, rbac.NodeLock); err != nil {
		t.Fatal(err)
	}
	tokenClient := func(boundTo string) kubernetes.Interface {
		return pluginTokenClient(ctx, t, c, rbac.Namespace, boundTo)
	}
	slice := func(name, node string) *resourceapi.ResourceSlice {
		return &resourceapi.ResourceSlice{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: resourceapi.ResourceSliceSpec{
				Driver: driverName, NodeName: ptr.To(node),
				Pool:    resourceapi.ResourcePool{Name: node, ResourceSliceCount: 1},
				Devices: []resourceapi.Device{{Name: "gpu-0"}},
			},
		}
	}
	// The policy takes effect asynchronously after it is created: wait
	// until a foreign write is refused, with a generous limit.
	onA := tokenClient("node-a")
	var err error
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		_, err = onA.ResourceV1().ResourceSlices().Create(ctx, slice("probe-b", "node-b"), metav1.CreateOptions{})
		if err != nil {
			break
		}
		_ = admin.ResourceV1().ResourceSlices().Delete(ctx, "probe-b", metav1.DeleteOptions{})
		time.Sleep(200 * time.Millisecond)
	}
	if err == nil || !strings.Contains(err.Error(), "may only write ResourceSlices of its own node") {
		t.Fatalf("plugin on node-a wrote node-b's slice: %v", err)
	}
	if _, err := onA.ResourceV1().ResourceSlices().Create(ctx, slice("own-a", "node-a"), metav1.CreateOptions{}); err != nil {
		t.Fatalf("plugin on node-a cannot write its own slice: %v", err)
	}
	// Nor may node-a's token write a slice of its own node in node-b's
	// pool (with a higher pool generation it would outrank node-b's own
	// slices in the scheduler) or of another driver.
	inPoolB := slice("pool-b", "node-a")
	inPoolB.Spec.Pool.Name = "node-b"
	otherDriver := slice("other-driver", "node-a")
	otherDriver.Spec.Driver = "gpu.example.com"
	for _, s := range []*resourceapi.ResourceSlice{inPoolB, otherDriver} {
		if _, err := onA.ResourceV1().ResourceSlices().Create(ctx, s, metav1.CreateOptions{}); err == nil || !strings.Contains(err.Error(), "in its own pool") {
			t.Errorf("plugin on node-a wrote slice %s (driver %s, pool %s): %v", s.Name, s.Spec.Driver, s.Spec.Pool.Name, err)
		}
	}
	// A slice of node-b (written by the admin) can be neither changed nor
	// deleted from node-a.
	if _, err := admin.ResourceV1().ResourceSlices().Create(ctx, slice("theirs-b", "node-b"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := onA.ResourceV1().ResourceSlices().Delete(ctx, "theirs-b", metav1.DeleteOptions{}); err == nil || !strings.Contains(err.Error(), "own node") {
		t.Errorf("plugin on node-a deleted node-b's slice: %v", err)
	}
	own, err := onA.ResourceV1().ResourceSlices().Get(ctx, "own-a", metav1.GetOptions{})
	if err == nil {
		t.Errorf("the plugin's role grants get, which it does not use: %v", own.Name)
	}
	if err := onA.ResourceV1().ResourceSlices().Delete(ctx, "own-a", metav1.DeleteOptions{}); err != nil {
		t.Errorf("plugin on node-a cannot delete its own slice: %v", err)
	}
	if _, err := tokenClient("").ResourceV1().ResourceSlices().Create(ctx, slice("unbound", "node-a"), metav1.CreateOptions{}); err == nil || !strings.Contains(err.Error(), "not bound to a node") {
		t.Errorf("a token without a node wrote a slice: %v", err)
	}
}

// pluginTokenClient is an API client with a token of the kubelet plugin's
// service account in namespace, bound to node boundTo (none when empty), as
// the kubelet's projected token of a DaemonSet pod is.
func pluginTokenClient(ctx context.Context, t *testing.T, c *cluster.Cluster, namespace, boundTo string) kubernetes.Interface {
	t.Helper()
	return tokenClient(ctx, t, c, namespace, rbac.KubeletPluginAccount, boundTo)
}
