package e2e

import (
	"context"
	"os"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
)

// l4Node simulates a PCIe server with four NVIDIA L4 (no NVLink, no MIG).
var l4Node = gpuNodeSpec{name: "l4-node", profile: "pcie-l4x4"}

// TestWholeGPUClaimsRunOnTesseraGPUs runs pods with whole-GPU claims on one
// cluster with Tessera's plugin: the ways a pod can ask for a GPU, and that
// a deleted pod gives its GPU back. The subtests share the cluster; each
// cleans up its namespace, so each finds every GPU free.
func TestWholeGPUClaimsRunOnTesseraGPUs(t *testing.T) {
	t.Parallel()
	c := startTessera(t, l4Node)
	ctx, cancel := context.WithTimeout(t.Context(), 4*time.Minute)
	defer cancel()
	node := c.nodes[l4Node.name]
	client := c.Client()

	t.Run("ClaimFromTemplateGetsExactlyItsGPU", func(t *testing.T) {
		c.LogsOnFailure(t)
		const ns = "template"
		c.newNamespace(ctx, t, ns)
		c.createTemplates(ctx, t, gpuTemplate(ns, "one-gpu", 1))
		pod := c.createAndRun(ctx, t, newGPUPod(ns, "trainer", gpuFrom("one-gpu")))
		claim := c.claimOf(ctx, t, pod, "gpu")
		results := claim.Status.Allocation.Devices.Results
		if len(results) != 1 || results[0].Driver != gpuClass || results[0].Pool != node.Name() {
			t.Fatalf("claim %s allocated %+v, want one device of driver %s in pool %s", claim.Name, results, gpuClass, node.Name())
		}
		if pod.Spec.NodeName != node.Name() {
			t.Errorf("pod runs on %s, want %s", pod.Spec.NodeName, node.Name())
		}
		if _, err := os.Stat(node.cdiSpecPath(t, claim)); err != nil {
			t.Errorf("CDI spec of prepared claim %s: %v", claim.Name, err)
		}
		rc := c.containerOf(t, pod)
		checkGPUContainer(t, node, rc, allocatedDevices(claim))
		t.Logf("pod %s got %s: device nodes %v, NVIDIA_VISIBLE_DEVICES=%s", pod.Name, allocatedDevices(claim), deviceNodes(rc, nil), rc.EnvMap()["NVIDIA_VISIBLE_DEVICES"])
	})

	t.Run("ClaimSharedByTwoPodsGivesBothTheSameGPU", func(t *testing.T) {
		c.LogsOnFailure(t)
		const ns = "shared"
		c.newNamespace(ctx, t, ns)
		claim := &resourceapi.ResourceClaim{
			ObjectMeta: metav1.ObjectMeta{Name: "shared-gpu", Namespace: ns},
			Spec:       gpuTemplate(ns, "", 1).Spec.Spec,
		}
		if _, err := client.ResourceV1().ResourceClaims(ns).Create(ctx, claim, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		var pods []*corev1.Pod
		for _, name := range []string{"reader", "writer"} {
			pod := newGPUPod(ns, name, corev1.PodResourceClaim{Name: "gpu", ResourceClaimName: ptr.To(claim.Name)})
			if _, err := client.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		for _, name := range []string{"reader", "writer"} {
			pods = append(pods, c.waitRunning(ctx, t, ns, name))
		}
		claim = c.claimOf(ctx, t, pods[0], "gpu")
		devices := allocatedDevices(claim)
		if len(devices) != 1 {
			t.Fatalf("shared claim allocated %v, want one GPU", devices)
		}
		for _, pod := range pods {
			if !slices.ContainsFunc(claim.Status.ReservedFor, func(r resourceapi.ResourceClaimConsumerReference) bool { return r.UID == pod.UID }) {
				t.Errorf("shared claim not reserved for pod %s: reservedFor %+v", pod.Name, claim.Status.ReservedFor)
			}
			checkGPUContainer(t, node, c.containerOf(t, pod), devices)
		}
	})

	t.Run("ExtendedResourceRequestGetsAGPU", func(t *testing.T) {
		c.LogsOnFailure(t)
		const ns = "extended"
		c.newNamespace(ctx, t, ns)
		pod := newGPUPod(ns, "legacy")
		pod.Spec.Containers[0].Resources.Limits = corev1.ResourceList{"gpu.tessera.dev/gpu": resource.MustParse("1")}
		pod = c.createAndRun(ctx, t, pod)
		if pod.Status.ExtendedResourceClaimStatus == nil {
			t.Fatalf("running pod %s has no extendedResourceClaimStatus: the scheduler did not back its GPU with a claim", pod.Name)
		}
		name := pod.Status.ExtendedResourceClaimStatus.ResourceClaimName
		claim, err := client.ResourceV1().ResourceClaims(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if claim.Status.Allocation == nil || len(claim.Status.Allocation.Devices.Results) != 1 {
			t.Fatalf("claim %s of the extended resource: allocation %+v, want one GPU", name, claim.Status.Allocation)
		}
		checkGPUContainer(t, node, c.containerOf(t, pod), allocatedDevices(claim))
	})

	t.Run("DeletedPodIsUnpreparedAndItsGPUAllocatableAgain", func(t *testing.T) {
		c.LogsOnFailure(t)
		const ns = "unprepare"
		c.newNamespace(ctx, t, ns)
		gpus := int64(node.gpuCount(t))
		for _, tmpl := range []*resourceapi.ResourceClaimTemplate{gpuTemplate(ns, "one-gpu", 1), gpuTemplate(ns, "all-gpus", gpus)} {
			c.createTemplates(ctx, t, tmpl)
		}
		first := c.createAndRun(ctx, t, newGPUPod(ns, "first", gpuFrom("one-gpu")))
		claim := c.claimOf(ctx, t, first, "gpu")
		spec := node.cdiSpecPath(t, claim)
		if _, err := os.Stat(spec); err != nil {
			t.Fatalf("CDI spec of prepared claim %s: %v", claim.Name, err)
		}

		c.deletePodsAndWait(ctx, t, first)
		eventually(ctx, t, time.Minute, "CDI spec "+spec+" of the deleted pod's claim removed (claim unprepared)", func() bool {
			_, err := os.Stat(spec)
			return os.IsNotExist(err)
		})

		// Every GPU of the node, the freed one included.
		all := c.createAndRun(ctx, t, onNode(newGPUPod(ns, "all", corev1.PodResourceClaim{Name: "gpus", ResourceClaimTemplateName: ptr.To("all-gpus")}), node.Name()))
		devices := allocatedDevices(c.claimOf(ctx, t, all, "gpus"))
		if int64(len(devices)) != gpus || !slices.Contains(devices, allocatedDevices(claim)[0]) {
			t.Errorf("pod needing all %d GPUs got %v, want all of them with the freed %s", gpus, devices, allocatedDevices(claim)[0])
		}
		checkGPUContainer(t, node, c.containerOf(t, all), devices)
	})
}
