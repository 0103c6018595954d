package e2e

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/utils/ptr"
)

// h100Node simulates a DGX H100: eight MIG-capable GPUs on one NVSwitch
// fabric; with DynamicMIG (default on) every MIG profile is offered.
var h100Node = gpuNodeSpec{name: "h100-node", profile: "dgx-h100"}

// TestMIGPartitionIsCreatedForItsPodAndDestroyedAfter asks for one 1g.10gb
// partition through the MIG DeviceClass: the plugin creates the GPU instance
// when the pod starts, hands the container the parent GPU and the MIG
// capability devices, and destroys the instance when the pod is gone.
func TestMIGPartitionIsCreatedForItsPodAndDestroyedAfter(t *testing.T) {
	t.Parallel()
	c := startTessera(t, h100Node)
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	node := c.nodes[h100Node.name]
	const ns = "mig"
	c.newNamespace(ctx, t, ns)

	instances := func() int {
		total := 0
		for i := range node.gpuCount(t) {
			total += node.Fake.GPUInstances(i)
		}
		return total
	}
	if n := instances(); n != 0 {
		t.Fatalf("fresh node has %d GPU instances, want 0", n)
	}
	template := migTemplate(ns, "one-slice", "1g.10gb")
	c.createTemplates(ctx, t, template)
	pod := c.createAndRun(ctx, t, newGPUPod(ns, "inference", corev1.PodResourceClaim{Name: "mig", ResourceClaimTemplateName: ptr.To(template.Name)}))
	devices := allocatedDevices(c.claimOf(ctx, t, pod, "mig"))
	if len(devices) != 1 {
		t.Fatalf("claim allocated %v, want one MIG device", devices)
	}
	var parent int
	if _, err := fmt.Sscanf(devices[0], "gpu-%d-mig-", &parent); err != nil {
		t.Fatalf("allocated device %q is not a MIG device gpu-<parent>-mig-...", devices[0])
	}
	if n := node.Fake.GPUInstances(parent); n != 1 {
		t.Errorf("GPU %d has %d GPU instances while the pod runs, want 1", parent, n)
	}
	if n := instances(); n != 1 {
		t.Errorf("node has %d GPU instances while the pod runs, want 1", n)
	}

	rc := c.containerOf(t, pod)
	wantGPU := fmt.Sprintf("/dev/nvidia%d", node.gpuOf(t, fmt.Sprintf("gpu-%d", parent)).minor)
	if got := deviceNodes(rc, gpuNodeRE); len(got) != 1 || got[0] != wantGPU {
		t.Errorf("container got GPU device nodes %v, want only the parent's %s", got, wantGPU)
	}
	if got := deviceNodes(rc, capNodeRE); len(got) != 2 {
		t.Errorf("container got MIG capability nodes %v, want two (GPU instance and compute instance access)", got)
	}
	checkCommon(t, rc)
	if visible := rc.EnvMap()["NVIDIA_VISIBLE_DEVICES"]; !strings.HasPrefix(visible, "MIG-") || strings.Contains(visible, ",") {
		t.Errorf("container got NVIDIA_VISIBLE_DEVICES=%q, want one MIG-<uuid>", visible)
	}
	t.Logf("pod %s got %s: device nodes %v, NVIDIA_VISIBLE_DEVICES=%s", pod.Name, devices[0], deviceNodes(rc, nil), rc.EnvMap()["NVIDIA_VISIBLE_DEVICES"])

	c.deletePodsAndWait(ctx, t, pod)
	eventually(ctx, t, time.Minute, "MIG instance destroyed after the pod was deleted", func() bool { return instances() == 0 })
	waitNoCDISpecs(ctx, t, node)
}
