package e2e

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/utils/ptr"

	"github.com/tessera-dev/tessera/driver/lazymig"
	"github.com/tessera-dev/tessera/driver/plugin"
)

// TestAPartitionWaitingInPreBindOnAVolumeIsNeverWithdrawnUnderIt runs, on
// the real scheduler, the two ways a partition could be allocated while
// lazy MIG publishing withdraws it, out of sight of the plugin's claim
// check at the grace's end:
//
//   - A pod allocated a partition while its GPU was open (pod "held", on
//     the spare gpu-6), whose binding then waits on a volume while the GPU
//     stops being the spare and its partitions are tainted for withdrawal.
//     kube-scheduler v1.37 runs the DynamicResources and VolumeBinding
//     PreBind steps side by side, so the allocation is in the API while the
//     volume still waits (asserted: were it not, the check could not see
//     it); at the grace's end the check finds it and counts again (the
//     taint is stamped anew), and once the volume binds and the pod is
//     prepared the GPU is open again: never withdrawn under it.
//   - A pod that tolerates every taint (pod "late"), asking for a
//     partition of that GPU while it is being withdrawn: the scheduler
//     must not allocate it one (each carries a counter its GPU has none
//     of), because a wait before its allocation is written (the
//     GangScheduling plugin's Permit, up to 5 minutes) could outlast the
//     grace and leave it holding a partition the scheduler no longer
//     counts. A pod that does not tolerate the taint ("probe") is refused
//     first, so the scheduler is known to have seen the withdrawal when
//     "late" is tried.
//
// The test plays the volume's binder (no PV controller runs), so it decides
// when "held"'s volume binds. It watches the node's slices throughout.
func TestAPartitionWaitingInPreBindOnAVolumeIsNeverWithdrawnUnderIt(t *testing.T) {
	t.Parallel()
	// Short, so that the claim check runs while pod held waits; the test
	// waits for its sign (a new stamp), not for the time.
	const grace = 20 * time.Second
	spec := h100Node
	spec.options = func(o *plugin.Options) { o.MIGWithdrawGrace = grace }
	c := startTessera(t, spec)
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
	defer cancel()
	client := c.Client()
	const ns = "withdraw"
	c.newNamespace(ctx, t, ns)

	watched := watchPartitions(ctx, t, c, spec.name)

	// A partition on gpu-7, the spare: gpu-6 becomes the spare.
	onGPU := func(name string, gpu int, tolerateAll bool) *resourceapi.ResourceClaimTemplate {
		tmpl := migTemplate(ns, name, "1g.10gb")
		req := tmpl.Spec.Spec.Devices.Requests[0].Exactly
		req.Selectors = append(req.Selectors, resourceapi.DeviceSelector{CEL: &resourceapi.CELDeviceSelector{
			Expression: fmt.Sprintf(`device.attributes["gpu.tessera.dev"].parentIndex == %d`, gpu),
		}})
		if tolerateAll {
			req.Tolerations = []resourceapi.DeviceToleration{{Operator: resourceapi.DeviceTolerationOpExists}}
		}
		return tmpl
	}
	c.createTemplates(ctx, t, onGPU("on-gpu-7", 7, false), onGPU("on-gpu-6", 6, false), onGPU("on-gpu-6-tolerating", 6, true))
	first := c.createAndRun(ctx, t, newGPUPod(ns, "first", gpuFrom("on-gpu-7")))
	eventually(ctx, t, time.Minute, "gpu-6's partitions published without the withdrawal taint", func() bool {
		s, ok := watched.state("gpu-6")
		return ok && s.published && s.tainted.IsZero()
	})

	// "held" is allocated a partition of gpu-6 and waits in PreBind on its
	// volume: a static volume of a WaitForFirstConsumer class, which the
	// scheduler reserves for it (the PV's claimRef) before it waits.
	if _, err := client.StorageV1().StorageClasses().Create(ctx, &storagev1.StorageClass{
		ObjectMeta:        metav1.ObjectMeta{Name: "withdraw-wait"},
		Provisioner:       "kubernetes.io/no-provisioner",
		VolumeBindingMode: ptr.To(storagev1.VolumeBindingWaitForFirstConsumer),
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: "withdraw-held"},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:                      corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
			AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			StorageClassName:              "withdraw-wait",
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimRetain,
			PersistentVolumeSource:        corev1.PersistentVolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: t.TempDir()}},
		},
	}
	created, err := client.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// What the PV controller would do: the scheduler binds only an
	// Available volume.
	created.Status.Phase = corev1.VolumeAvailable
	if _, err := client.CoreV1().PersistentVolumes().UpdateStatus(ctx, created, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	pvc := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "held-data", Namespace: ns},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			StorageClassName: ptr.To("withdraw-wait"),
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
		},
	}
	if _, err := client.CoreV1().PersistentVolumeClaims(ns).Create(ctx, pvc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	held := newGPUPod(ns, "held", gpuFrom("on-gpu-6"))
	held.Spec.Volumes = []corev1.Volume{{Name: "data", VolumeSource: corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: pvc.Name}}}}
	if _, err := client.CoreV1().Pods(ns).Create(ctx, held, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(ctx, t, time.Minute, "the scheduler reserving the volume for pod held (PreBind)", func() bool {
		got, err := client.CoreV1().PersistentVolumes().Get(ctx, pv.Name, metav1.GetOptions{})
		return err == nil && got.Spec.ClaimRef != nil && got.Spec.ClaimRef.Name == pvc.Name
	})
	eventually(ctx, t, time.Minute, "pod held's partition of gpu-6 allocated in the API while its volume waits", func() bool {
		return len(allocatedOn(ctx, t, c, ns, "gpu-6-")) == 1
	})
	if got, err := client.CoreV1().PersistentVolumeClaims(ns).Get(ctx, pvc.Name, metav1.GetOptions{}); err != nil || got.Spec.VolumeName != "" {
		t.Fatalf("pod held's volume claim is bound (%v), so the allocation above did not come while the volume waited", err)
	}

	// gpu-7 is free again and the spare: gpu-6, which holds nothing
	// prepared, is withdrawn.
	c.deletePodsAndWait(ctx, t, first)
	var stamp time.Time
	eventually(ctx, t, time.Minute, "gpu-6's partitions published with the withdrawal taint", func() bool {
		s, ok := watched.state("gpu-6")
		stamp = s.tainted
		return ok && s.published && !s.tainted.IsZero()
	})

	// The scheduler has seen the withdrawal once it refuses a pod that does
	// not tolerate it; the one that tolerates every taint is tried after.
	unschedulable := func(p *corev1.Pod) bool {
		for _, cond := range p.Status.Conditions {
			if cond.Type == corev1.PodScheduled && cond.Status == corev1.ConditionFalse && cond.Reason == corev1.PodReasonUnschedulable {
				return true
			}
		}
		return false
	}
	for _, p := range []*corev1.Pod{newGPUPod(ns, "probe", gpuFrom("on-gpu-6")), newGPUPod(ns, "late", gpuFrom("on-gpu-6-tolerating"))} {
		if _, err := client.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		c.waitForPod(ctx, t, ns, p.Name, "refused by the scheduler while gpu-6's partitions are withdrawn", time.Minute, func(got *corev1.Pod) bool {
			if got.Spec.NodeName != "" {
				t.Fatalf("pod %s was bound to %s while gpu-6's partitions were being withdrawn (claims allocated on gpu-6: %v)", p.Name, got.Spec.NodeName, allocatedOn(ctx, t, c, ns, "gpu-6-"))
			}
			return unschedulable(got)
		})
	}
	if claims := allocatedOn(ctx, t, c, ns, "gpu-6-"); len(claims) != 1 {
		t.Fatalf("claims %v are allocated partitions of gpu-6, want pod held's alone", claims)
	}

	// The grace ends with held's claim allocated: the check keeps gpu-6's
	// partitions published and counts again (a new stamp).
	eventually(ctx, t, grace+time.Minute, "the withdrawal put off (gpu-6's taint stamped anew) for pod held's claim", func() bool {
		s, _ := watched.state("gpu-6")
		return s.published && s.tainted.After(stamp)
	})

	// The test, as the volume's binder, binds it: the kubelet prepares the
	// partition and gpu-6 is open again under it.
	bindVolume(ctx, t, c, pv.Name, ns, pvc.Name)
	held = c.waitRunning(ctx, t, ns, held.Name)
	devices := allocatedDevices(c.claimOf(ctx, t, held, "gpu"))
	if len(devices) != 1 || !strings.HasPrefix(devices[0], "gpu-6-mig-") {
		t.Fatalf("pod held was allocated %v, want one partition of gpu-6", devices)
	}
	eventually(ctx, t, time.Minute, "gpu-6's partitions published without the withdrawal taint under pod held", func() bool {
		s, ok := watched.state("gpu-6")
		return ok && s.published && s.tainted.IsZero()
	})
	// Held, gpu-6 is withdrawn no more (lazymig.Decide); the watch judged
	// every generation up to this one.
	if gaps := watched.gaps("gpu-6"); len(gaps) != 0 {
		t.Fatalf("gpu-6's partitions were withdrawn while pod held was allocated one: %v", gaps)
	}
	cancel()
}

// partitionsSeen is what the watch last saw of a GPU's partitions: whether
// they are published, and the withdrawal taint's stamp (zero: untainted).
type partitionsSeen struct {
	published bool
	tainted   time.Time
}

// partitionWatch follows one node's pool through a watch on its slices
// and keeps, per GPU, what its complete generations published, and every
// moment a GPU's partitions were missing after they were first seen.
type partitionWatch struct {
	mu     sync.Mutex
	seen   map[string]partitionsSeen
	missed map[string][]string
}

func (w *partitionWatch) state(gpu string) (partitionsSeen, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	s, ok := w.seen[gpu]
	return s, ok
}

func (w *partitionWatch) gaps(gpu string) []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]string(nil), w.missed[gpu]...)
}

// watchPartitions watches node's ResourceSlices until ctx ends. A pool is
// judged only when every slice of its newest generation has been seen.
func watchPartitions(ctx context.Context, t *testing.T, c *tesseraCluster, node string) *partitionWatch {
	t.Helper()
	w := &partitionWatch{seen: map[string]partitionsSeen{}, missed: map[string][]string{}}
	sel := resourceapi.ResourceSliceSelectorNodeName + "=" + node
	list, err := c.Client().ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: sel})
	if err != nil {
		t.Fatal(err)
	}
	slices := map[string]*resourceapi.ResourceSlice{}
	for i := range list.Items {
		slices[list.Items[i].Name] = &list.Items[i]
	}
	judge := func() {
		var gen int64
		var count int64
		for _, s := range slices {
			if s.Spec.Pool.Generation > gen {
				gen, count = s.Spec.Pool.Generation, s.Spec.Pool.ResourceSliceCount
			}
		}
		now := map[string]partitionsSeen{}
		n := int64(0)
		for _, s := range slices {
			if s.Spec.Pool.Generation != gen {
				continue
			}
			n++
			for _, d := range s.Spec.Devices {
				gpu, _, isPartition := strings.Cut(d.Name, "-mig-")
				if !isPartition {
					continue
				}
				p := now[gpu]
				p.published = true
				for _, tn := range d.Taints {
					if tn.Key == lazymig.TaintKey && tn.TimeAdded != nil && tn.TimeAdded.After(p.tainted) {
						p.tainted = tn.TimeAdded.Time
					}
				}
				now[gpu] = p
			}
		}
		if n != count {
			return // mid-rewrite
		}
		w.mu.Lock()
		defer w.mu.Unlock()
		for gpu, was := range w.seen {
			if was.published && !now[gpu].published {
				w.missed[gpu] = append(w.missed[gpu], fmt.Sprintf("withdrawn at %s (pool generation %d)", time.Now().Format(time.RFC3339Nano), gen))
			}
		}
		w.seen = now
	}
	judge()
	wi, err := c.Client().ResourceV1().ResourceSlices().Watch(ctx, metav1.ListOptions{FieldSelector: sel, ResourceVersion: list.ResourceVersion})
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		defer wi.Stop()
		for ev := range wi.ResultChan() {
			s, ok := ev.Object.(*resourceapi.ResourceSlice)
			if !ok {
				continue
			}
			switch ev.Type {
			case watch.Added, watch.Modified:
				slices[s.Name] = s
			case watch.Deleted:
				delete(slices, s.Name)
			}
			judge()
		}
	}()
	return w
}

// allocatedOn names the claims in ns allocated a device whose name starts
// with prefix, from the API.
func allocatedOn(ctx context.Context, t *testing.T, c *tesseraCluster, ns, prefix string) []string {
	t.Helper()
	list, err := c.Client().ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for i := range list.Items {
		if list.Items[i].Status.Allocation == nil {
			continue
		}
		for _, d := range allocatedDevices(&list.Items[i]) {
			if strings.HasPrefix(d, prefix) {
				out = append(out, list.Items[i].Name+"="+d)
			}
		}
	}
	return out
}

// bindVolume completes the binding the scheduler asked for (the PV's
// claimRef), as the PV controller would: the claim names the volume and
// both are Bound.
func bindVolume(ctx context.Context, t *testing.T, c *tesseraCluster, pvName, ns, pvcName string) {
	t.Helper()
	client := c.Client()
	pvc, err := client.CoreV1().PersistentVolumeClaims(ns).Get(ctx, pvcName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pvc.Spec.VolumeName = pvName
	if pvc.Annotations == nil {
		pvc.Annotations = map[string]string{}
	}
	pvc.Annotations["pv.kubernetes.io/bind-completed"] = "yes"
	if pvc, err = client.CoreV1().PersistentVolumeClaims(ns).Update(ctx, pvc, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("bind claim %s/%s to %s: %v", ns, pvcName, pvName, err)
	}
	pvc.Status.Phase = corev1.ClaimBound
	pvc.Status.AccessModes = pvc.Spec.AccessModes
	pvc.Status.Capacity = pvc.Spec.Resources.Requests
	if _, err := client.CoreV1().PersistentVolumeClaims(ns).UpdateStatus(ctx, pvc, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("claim %s/%s status Bound: %v", ns, pvcName, err)
	}
	pv, err := client.CoreV1().PersistentVolumes().Get(ctx, pvName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pv.Status.Phase = corev1.VolumeBound
	if _, err := client.CoreV1().PersistentVolumes().UpdateStatus(ctx, pv, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("volume %s status Bound: %v", pvName, err)
	}
}
