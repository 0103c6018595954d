package e2e

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

var healthNode = gpuNodeSpec{name: "health-node", profile: "pcie-l4x4"}

// TestUnhealthyGPUShowsInPodStatusAndGetsNoNewWork faults the GPU a running
// pod holds (XID 48, a double-bit ECC error): the kubelet shows the device
// Unhealthy in the pod's status (from the plugin's health stream), the
// published device is tainted NoSchedule, and once the pod is gone new pods
// land only on the healthy GPUs.
func TestUnhealthyGPUShowsInPodStatusAndGetsNoNewWork(t *testing.T) {
	t.Parallel()
	c := startTessera(t, healthNode)
	ctx, cancel := context.WithTimeout(t.Context(), 4*time.Minute)
	defer cancel()
	node := c.nodes[healthNode.name]
	client := c.Client()
	const ns = "health"
	c.newNamespace(ctx, t, ns)

	c.createTemplates(ctx, t, gpuTemplate(ns, "one", 1))
	claimRef := gpuFrom("one")
	victim := c.createAndRun(ctx, t, newGPUPod(ns, "victim", claimRef))
	devices := allocatedDevices(c.claimOf(ctx, t, victim, "gpu"))
	if len(devices) != 1 {
		t.Fatalf("allocated %v", devices)
	}
	bad := node.gpuOf(t, devices[0])
	if err := node.Fake.InjectXID(bad.index, 48); err != nil {
		t.Fatal(err)
	}

	// The kubelet reports the device's health in the container's status.
	c.waitForPod(ctx, t, ns, victim.Name, "showing its GPU unhealthy", 90*time.Second, func(p *corev1.Pod) bool {
		for _, cs := range p.Status.ContainerStatuses {
			for _, rs := range cs.AllocatedResourcesStatus {
				for _, r := range rs.Resources {
					// The kubelet names the device by its CDI ID.
					id := string(r.ResourceID)
					if strings.HasPrefix(id, "gpu.tessera.dev/gpu=") && strings.HasSuffix(id, "-"+devices[0]) && r.Health == corev1.ResourceHealthStatusUnhealthy {
						return true
					}
				}
			}
		}
		return false
	})

	// The published device carries a NoSchedule taint naming the XID.
	eventually(ctx, t, 30*time.Second, "tainted in the ResourceSlice", func() bool {
		list, err := client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false
		}
		for _, s := range list.Items {
			for _, d := range s.Spec.Devices {
				if d.Name == devices[0] && slices.ContainsFunc(d.Taints, func(tt resourceapi.DeviceTaint) bool {
					return tt.Key == "gpu.tessera.dev/xid" && tt.Value == "48" && tt.Effect == "NoSchedule"
				}) {
					return true
				}
			}
		}
		return false
	})

	// Free the faulty GPU: new work still must not land on it.
	c.deletePodsAndWait(ctx, t, victim)
	c.createTemplates(ctx, t, gpuTemplate(ns, "three", 3))
	healthy := c.createAndRun(ctx, t, newGPUPod(ns, "healthy", gpuFrom("three")))
	got := allocatedDevices(c.claimOf(ctx, t, healthy, "gpu"))
	if len(got) != 3 || slices.Contains(got, devices[0]) {
		t.Fatalf("new pod got %v; the tainted %s must not be among them", got, devices[0])
	}
	// Only the tainted GPU is left: a further pod waits.
	if _, err := client.CoreV1().Pods(ns).Create(ctx, newGPUPod(ns, "waiting", claimRef), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	c.waitForPod(ctx, t, ns, "waiting", "unschedulable", 60*time.Second, func(p *corev1.Pod) bool {
		for _, cond := range p.Status.Conditions {
			if cond.Type == corev1.PodScheduled && cond.Status == corev1.ConditionFalse && cond.Reason == corev1.PodReasonUnschedulable {
				return true
			}
		}
		return false
	})
}
