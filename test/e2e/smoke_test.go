package e2e

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"github.com/tessera-dev/tessera/test/cluster"
)

const (
	driverName = "gpu.tessera.dev"
	nodeName   = "gpu-node-1"
	namespace  = "smoke"
)

const deviceClassYAML = `
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata:
  name: gpu.tessera.dev
spec:
  selectors:
  - cel:
      expression: device.driver == "gpu.tessera.dev"
`

// TestSmokePlainPodRunsAndClaimIsAllocated checks the local cluster end to
// end without a DRA plugin: a plain pod runs and its container reaches the
// runtime; a pod with a claim template is scheduled onto the node that
// publishes matching devices and its generated claim is allocated there.
func TestSmokePlainPodRunsAndClaimIsAllocated(t *testing.T) {
	t.Parallel()
	c := cluster.StartT(t, cluster.Options{Nodes: []cluster.NodeSpec{{Name: nodeName}}})
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	client := c.Client()
	if err := c.CreateNamespace(ctx, namespace); err != nil {
		t.Fatal(err)
	}

	t.Run("PlainPodRuns", func(t *testing.T) {
		c.LogsOnFailure(t)
		pod := newPod("plain")
		if _, err := client.CoreV1().Pods(namespace).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		waitForPod(ctx, t, c, pod.Name, "Running", func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodRunning })
		if !slices.ContainsFunc(c.Node(nodeName).Containers(), func(rc cluster.RecordedContainer) bool {
			return rc.PodNamespace == namespace && rc.PodName == pod.Name && rc.Name == "main"
		}) {
			t.Errorf("runtime of %s recorded no container main of pod %s/%s; it has %+v",
				nodeName, namespace, pod.Name, c.Node(nodeName).Containers())
		}
	})

	t.Run("ClaimFromTemplateIsAllocated", func(t *testing.T) {
		c.LogsOnFailure(t)
		if err := c.Apply(ctx, []byte(deviceClassYAML)); err != nil {
			t.Fatal(err)
		}
		publishSlice(ctx, t, c)
		template := &resourceapi.ResourceClaimTemplate{
			ObjectMeta: metav1.ObjectMeta{Name: "one-gpu", Namespace: namespace},
			Spec: resourceapi.ResourceClaimTemplateSpec{Spec: resourceapi.ResourceClaimSpec{
				Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
					Name:    "gpu",
					Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: driverName},
				}}},
			}},
		}
		if _, err := client.ResourceV1().ResourceClaimTemplates(namespace).Create(ctx, template, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		pod := newPod("with-gpu")
		pod.Spec.ResourceClaims = []corev1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: ptr.To(template.Name)}}
		pod.Spec.Containers[0].Resources.Claims = []corev1.ResourceClaim{{Name: "gpu"}}
		if _, err := client.CoreV1().Pods(namespace).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}

		// No plugin runs, so the pod cannot start: check scheduling only.
		pod = waitForPod(ctx, t, c, pod.Name, "bound with a generated claim", func(p *corev1.Pod) bool {
			return p.Spec.NodeName != "" && len(p.Status.ResourceClaimStatuses) == 1 &&
				p.Status.ResourceClaimStatuses[0].ResourceClaimName != nil
		})
		if pod.Spec.NodeName != nodeName {
			t.Errorf("pod bound to node %q, want %q", pod.Spec.NodeName, nodeName)
		}
		claimName := *pod.Status.ResourceClaimStatuses[0].ResourceClaimName
		claim, err := client.ResourceV1().ResourceClaims(namespace).Get(ctx, claimName, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		checkAllocation(t, claim, pod)
	})
}

func publishSlice(ctx context.Context, t *testing.T, c *cluster.Cluster) {
	t.Helper()
	slice := &resourceapi.ResourceSlice{
		ObjectMeta: metav1.ObjectMeta{Name: nodeName + "-" + driverName},
		Spec: resourceapi.ResourceSliceSpec{
			Driver:   driverName,
			NodeName: ptr.To(nodeName),
			Pool:     resourceapi.ResourcePool{Name: nodeName, ResourceSliceCount: 1},
		},
	}
	for i := range 2 {
		slice.Spec.Devices = append(slice.Spec.Devices, resourceapi.Device{
			Name: fmt.Sprintf("gpu-%d", i),
			Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
				"productName": {StringValue: ptr.To("NVIDIA H100 80GB HBM3")},
			},
		})
	}
	if _, err := c.Client().ResourceV1().ResourceSlices().Create(ctx, slice, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

func checkAllocation(t *testing.T, claim *resourceapi.ResourceClaim, pod *corev1.Pod) {
	t.Helper()
	alloc := claim.Status.Allocation
	if alloc == nil {
		t.Fatalf("claim %s is not allocated: %+v", claim.Name, claim.Status)
	}
	if len(alloc.Devices.Results) != 1 {
		t.Fatalf("claim %s: want 1 allocated device, got %+v", claim.Name, alloc.Devices.Results)
	}
	r := alloc.Devices.Results[0]
	if r.Request != "gpu" || r.Driver != driverName || r.Pool != nodeName || (r.Device != "gpu-0" && r.Device != "gpu-1") {
		t.Errorf("claim %s: allocated %s/%s/%s for request %q, want a gpu-N of %s/%s for request gpu",
			claim.Name, r.Driver, r.Pool, r.Device, r.Request, driverName, nodeName)
	}
	if !selectsNode(alloc.NodeSelector, nodeName) {
		t.Errorf("claim %s: allocation node selector %+v does not select node %s", claim.Name, alloc.NodeSelector, nodeName)
	}
	if !slices.ContainsFunc(claim.Status.ReservedFor, func(ref resourceapi.ResourceClaimConsumerReference) bool {
		return ref.UID == pod.UID
	}) {
		t.Errorf("claim %s: not reserved for pod %s (reservedFor %+v)", claim.Name, pod.Name, claim.Status.ReservedFor)
	}
}

// selectsNode reports whether a node selector names the node by
// metadata.name, as the scheduler writes it for node-local slices.
func selectsNode(sel *corev1.NodeSelector, node string) bool {
	if sel == nil {
		return false
	}
	for _, term := range sel.NodeSelectorTerms {
		for _, f := range term.MatchFields {
			if f.Key == "metadata.name" && f.Operator == corev1.NodeSelectorOpIn && slices.Contains(f.Values, node) {
				return true
			}
		}
	}
	return false
}

func newPod(name string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace},
		Spec: corev1.PodSpec{
			Containers:                    []corev1.Container{{Name: "main", Image: "registry.k8s.io/pause:3.10"}},
			TerminationGracePeriodSeconds: ptr.To[int64](0),
		},
	}
}

// waitForPod waits for a pod in the smoke namespace; see waitForPodIn.
func waitForPod(ctx context.Context, t *testing.T, c *cluster.Cluster, name, what string, done func(*corev1.Pod) bool) *corev1.Pod {
	t.Helper()
	return waitForPodIn(ctx, t, c, namespace, name, what, done)
}

// waitForPodIn polls the pod until done accepts it and returns it; on
// timeout the test fails with the pod's last status.
func waitForPodIn(ctx context.Context, t *testing.T, c *cluster.Cluster, namespace, name, what string, done func(*corev1.Pod) bool) *corev1.Pod {
	t.Helper()
	return pollPod(ctx, t, c.Client(), namespace, name, what, time.Minute, done, nil)
}

// pollPod polls a pod until done accepts it and returns it; on timeout the
// test fails with the pod's last status and, when given, more context.
func pollPod(ctx context.Context, t testing.TB, client kubernetes.Interface, ns, name, what string, timeout time.Duration, done func(*corev1.Pod) bool, more func() string) *corev1.Pod {
	t.Helper()
	var pod *corev1.Pod
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		p, err := client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		pod = p
		return done(p), nil
	})
	if err != nil {
		var status any
		if pod != nil {
			status = pod.Status
		}
		extra := ""
		if more != nil {
			extra = "\n" + more()
		}
		t.Fatalf("pod %s/%s not %s within %v: %v\nlast status: %+v%s", ns, name, what, timeout, err, status, extra)
	}
	return pod
}
