package e2e

import (
	"context"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/ptr"

	"github.com/tessera-dev/tessera/driver/plugin"
)

// TestSharedGPUsOnTheLocalCluster runs the three ways pods share a GPU on a
// pcie-l4x4 node whose GPU 0 is cut into three time slices, GPU 1 is shared
// by memory and GPUs 2 and 3 are whole, with the real scheduler allocating.
func TestSharedGPUsOnTheLocalCluster(t *testing.T) {
	t.Parallel()
	tc := startTessera(t, gpuNodeSpec{name: "share-node", profile: "pcie-l4x4", options: func(o *plugin.Options) {
		o.TimeSlicedGPUs = "0=3"
		o.MemorySharedGPUs = "1"
		o.MPSImage = pause
	}})
	_, ctx := ktesting.NewTestContext(t)
	ctx, cancel := context.WithTimeout(ctx, 6*time.Minute)
	defer cancel()
	n := tc.nodes["share-node"]
	client := tc.Client()

	t.Run("two pods share one claim's time-sliced GPU", func(t *testing.T) {
		tc.LogsOnFailure(t)
		const ns = "notebooks"
		if err := tc.CreateNamespace(ctx, ns); err != nil {
			t.Fatal(err)
		}
		// The operator keeps whole GPUs Prohibited until a claim needs them:
		// a time-sliced claim must switch its GPU to Default and back.
		for _, i := range []int{2, 3} {
			if ret := n.Fake.Server.Devices[i].SetComputeMode(nvml.COMPUTEMODE_PROHIBITED); ret != nvml.SUCCESS {
				t.Fatal(ret)
			}
		}
		claim := &resourceapi.ResourceClaim{
			ObjectMeta: metav1.ObjectMeta{Name: "shared-notebook", Namespace: ns},
			Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
				Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: gpuClass}}},
				Config: []resourceapi.DeviceClaimConfiguration{{DeviceConfiguration: resourceapi.DeviceConfiguration{Opaque: &resourceapi.OpaqueDeviceConfiguration{
					Driver:     gpuClass,
					Parameters: runtime.RawExtension{Raw: []byte(`{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"TimeSlicing"}}`)},
				}}}},
			}},
		}
		if _, err := client.ResourceV1().ResourceClaims(ns).Create(ctx, claim, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		var uuids []string
		var pods []*corev1.Pod
		for _, name := range []string{"writer", "reader"} {
			pod := tc.createAndRun(ctx, t, newGPUPod(ns, name, corev1.PodResourceClaim{Name: "gpu", ResourceClaimName: ptr.To(claim.Name)}))
			uuids = append(uuids, tc.containerOf(t, pod).EnvMap()["NVIDIA_VISIBLE_DEVICES"])
			pods = append(pods, pod)
		}
		got := tc.claimOf(ctx, t, pods[0], "gpu")
		dev := allocatedDevices(got)
		if len(dev) != 1 {
			t.Fatalf("claim allocated %v, want one GPU", dev)
		}
		g := n.gpuOf(t, dev[0])
		if uuids[0] != g.uuid || uuids[1] != g.uuid {
			t.Errorf("containers see GPUs %v, want both %s (%s)", uuids, g.uuid, dev[0])
		}
		if mode := n.Fake.ComputeMode(g.index); mode != nvml.COMPUTEMODE_DEFAULT {
			t.Errorf("GPU %d compute mode %d while time-sliced, want Default", g.index, mode)
		}
		deletePods(ctx, t, tc, pods...)
		waitFor(ctx, t, "compute mode restored after the last pod", func() bool {
			return n.Fake.ComputeMode(g.index) == nvml.COMPUTEMODE_PROHIBITED
		})
	})

	t.Run("pods of one claim share a GPU through an MPS daemon pod", func(t *testing.T) {
		tc.LogsOnFailure(t)
		const ns = "mps"
		if err := tc.CreateNamespace(ctx, ns); err != nil {
			t.Fatal(err)
		}
		claim := &resourceapi.ResourceClaim{
			ObjectMeta: metav1.ObjectMeta{Name: "mps-gpu", Namespace: ns},
			Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
				Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "mps.gpu.tessera.dev"}}},
				Config: []resourceapi.DeviceClaimConfiguration{{DeviceConfiguration: resourceapi.DeviceConfiguration{Opaque: &resourceapi.OpaqueDeviceConfiguration{
					Driver:     gpuClass,
					Parameters: runtime.RawExtension{Raw: []byte(`{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","mpsConfig":{"defaultActiveThreadPercentage":50}}}`)},
				}}}},
			}},
		}
		if _, err := client.ResourceV1().ResourceClaims(ns).Create(ctx, claim, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		var pods []*corev1.Pod
		for _, name := range []string{"client-a", "client-b"} {
			pod := tc.createAndRun(ctx, t, newGPUPod(ns, name, corev1.PodResourceClaim{Name: "gpu", ResourceClaimName: ptr.To(claim.Name)}))
			env := tc.containerOf(t, pod).EnvMap()
			if env["CUDA_MPS_PIPE_DIRECTORY"] == "" || env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] != "50" {
				t.Errorf("pod %s: MPS client env %v lacks the pipe directory or the thread limit", name, env)
			}
			pods = append(pods, pod)
		}
		got := tc.claimOf(ctx, t, pods[0], "gpu")
		daemon := "tessera-mps-" + string(got.UID)
		// The plugin started the daemon as its own service account; the
		// kubelet runs it.
		d, err := client.CoreV1().Pods("tessera-system").Get(ctx, daemon, metav1.GetOptions{})
		if err != nil {
			t.Fatalf("MPS daemon pod: %v", err)
		}
		if d.Spec.NodeName != n.Name() || d.Status.Phase != corev1.PodRunning {
			t.Errorf("MPS daemon pod on %q in phase %s, want running on %s", d.Spec.NodeName, d.Status.Phase, n.Name())
		}
		g := n.gpuOf(t, allocatedDevices(got)[0])
		if mode := n.Fake.ComputeMode(g.index); mode != nvml.COMPUTEMODE_EXCLUSIVE_PROCESS {
			t.Errorf("GPU %d compute mode %d under MPS, want ExclusiveProcess", g.index, mode)
		}
		deletePods(ctx, t, tc, pods...)
		waitFor(ctx, t, "MPS daemon pod deleted after the last client", func() bool {
			_, err := client.CoreV1().Pods("tessera-system").Get(ctx, daemon, metav1.GetOptions{})
			return err != nil
		})
	})

	t.Run("independent claims take time slices up to N", func(t *testing.T) {
		tc.LogsOnFailure(t)
		const ns = "slices"
		if err := tc.CreateNamespace(ctx, ns); err != nil {
			t.Fatal(err)
		}
		tmpl := shareTemplate(ns, "slice", "timeslice.gpu.tessera.dev", nil)
		tc.createTemplates(ctx, t, tmpl)
		g0 := n.gpuOf(t, "gpu-0")
		var pods []*corev1.Pod
		for _, name := range []string{"slice-a", "slice-b", "slice-c"} {
			pod := tc.createAndRun(ctx, t, newGPUPod(ns, name, gpuFrom(tmpl.Name)))
			if got := tc.containerOf(t, pod).EnvMap()["NVIDIA_VISIBLE_DEVICES"]; got != g0.uuid {
				t.Errorf("pod %s sees GPU %q, want the time-sliced gpu-0 %s", name, got, g0.uuid)
			}
			pods = append(pods, pod)
		}
		fourth := newGPUPod(ns, "slice-d", gpuFrom(tmpl.Name))
		if _, err := client.CoreV1().Pods(ns).Create(ctx, fourth, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		tc.waitForPod(ctx, t, ns, fourth.Name, "unschedulable", time.Minute, unschedulable)
		// Capacity, not a fault, keeps it waiting: freeing a slice lets it run.
		deletePods(ctx, t, tc, pods[0])
		tc.waitRunning(ctx, t, ns, fourth.Name)
	})

	t.Run("memory shares fill one GPU without overcommit", func(t *testing.T) {
		tc.LogsOnFailure(t)
		const ns = "memshares"
		if err := tc.CreateNamespace(ctx, ns); err != nil {
			t.Fatal(err)
		}
		tmpl := shareTemplate(ns, "ten-gib", "memory.gpu.tessera.dev", map[resourceapi.QualifiedName]resource.Quantity{"memory": resource.MustParse("10Gi")})
		tc.createTemplates(ctx, t, tmpl)
		g1 := n.gpuOf(t, "gpu-1")
		for _, name := range []string{"mem-a", "mem-b"} {
			pod := tc.createAndRun(ctx, t, newGPUPod(ns, name, gpuFrom(tmpl.Name)))
			env := tc.containerOf(t, pod).EnvMap()
			if env["NVIDIA_VISIBLE_DEVICES"] != g1.uuid || env["TESSERA_GPU_1_MEMORY_LIMIT_MIB"] != "10240" {
				t.Errorf("pod %s: NVIDIA_VISIBLE_DEVICES=%q TESSERA_GPU_1_MEMORY_LIMIT_MIB=%q, want gpu-1 %s and 10240", name, env["NVIDIA_VISIBLE_DEVICES"], env["TESSERA_GPU_1_MEMORY_LIMIT_MIB"], g1.uuid)
			}
		}
		third := newGPUPod(ns, "mem-c", gpuFrom(tmpl.Name))
		if _, err := client.CoreV1().Pods(ns).Create(ctx, third, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		tc.waitForPod(ctx, t, ns, third.Name, "unschedulable", time.Minute, unschedulable)
	})
}

func shareTemplate(ns, name, class string, capacity map[resourceapi.QualifiedName]resource.Quantity) *resourceapi.ResourceClaimTemplate {
	req := &resourceapi.ExactDeviceRequest{DeviceClassName: class}
	if capacity != nil {
		req.Capacity = &resourceapi.CapacityRequirements{Requests: capacity}
	}
	return &resourceapi.ResourceClaimTemplate{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: resourceapi.ResourceClaimTemplateSpec{Spec: resourceapi.ResourceClaimSpec{
			Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: req}}},
		}},
	}
}

// unschedulable says the scheduler tried the pod and found no place.
func unschedulable(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && c.Reason == corev1.PodReasonUnschedulable {
			return p.Spec.NodeName == ""
		}
	}
	return false
}

func deletePods(ctx context.Context, t *testing.T, tc *tesseraCluster, pods ...*corev1.Pod) {
	t.Helper()
	for _, p := range pods {
		if err := tc.Client().CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range pods {
		waitFor(ctx, t, "pod "+p.Name+" gone", func() bool {
			_, err := tc.Client().CoreV1().Pods(p.Namespace).Get(ctx, p.Name, metav1.GetOptions{})
			return err != nil
		})
	}
}

func waitFor(ctx context.Context, t *testing.T, what string, cond func() bool) {
	t.Helper()
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 90*time.Second, true, func(context.Context) (bool, error) { return cond(), nil })
	if err != nil {
		t.Fatalf("waiting for %s: %v", what, err)
	}
}
