package e2e

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/utils/ptr"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/controller/gang"
)

// This file holds TestGangPlacement's subtests of what the controller
// repairs: a member refused at prepare because the scheduler allocated its
// device to another claim too, and a placement cut short whose gang's
// selector changed before the controller came back.

// doubleAllocation is refusedAtPrepare's double allocation, forced: a gated
// small pod whose claim the test gives member 0's device once the scheduler
// has allocated it (at the bind step: the members wait to bind), letting the
// small pod start before the members bind. Tessera never allocates a device
// twice; the test plays a foreign allocator that does (another controller
// writing allocations beside the scheduler), to hold the repairs that keep a
// gang whole even then.
type doubleAllocation struct {
	small      *corev1.Pod
	smallClaim string
	// first is the placement whose member 0 lost its device ("" until the
	// hook ran); taken is that device.
	first   func() string
	taken   *atomic.Pointer[resourceapi.DeviceRequestAllocationResult]
	takeErr *atomic.Value
	began   time.Time
}

// raceForMemberZero sets up the double allocation in ns and creates a
// 4-member gang of an indexed Job there.
func (e gangEnv) raceForMemberZero(ctx context.Context, t *testing.T, ns string) *doubleAllocation {
	e.setUp(ctx, t, ns)
	client := e.c.Client()
	small := newGPUPod(ns, "small", gpuFrom("one-gpu"))
	small.Spec.SchedulingGates = []corev1.PodSchedulingGate{{Name: "example.com/hold"}}
	noErr(t, ok(client.CoreV1().Pods(ns).Create(ctx, small, metav1.CreateOptions{})))
	var smallClaim string
	waitFor(ctx, t, "the small pod's claim", func() bool {
		p, err := client.CoreV1().Pods(ns).Get(ctx, "small", metav1.GetOptions{})
		if err == nil && len(p.Status.ResourceClaimStatuses) == 1 && p.Status.ResourceClaimStatuses[0].ResourceClaimName != nil {
			smallClaim, small = *p.Status.ResourceClaimStatuses[0].ResourceClaimName, p
		}
		return smallClaim != ""
	})
	t.Cleanup(func() { e.c.deletePodsAndWait(context.WithoutCancel(ctx), t, small) })

	// take gives the small claim member 0's device, as a foreign allocator would,
	// and waits until the small pod runs on it: its prepare comes first.
	// first is written by the controller's goroutine (the hook) and read
	// by the test's.
	var firstPlacement atomic.Pointer[string]
	first := func() string {
		if p := firstPlacement.Load(); p != nil {
			return *p
		}
		return ""
	}
	var taken atomic.Pointer[resourceapi.DeviceRequestAllocationResult]
	take := func() error {
		list, err := client.ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		for _, mc := range list.Items {
			if mc.Annotations[gangv1.AnnotationRank] != "0" || mc.Status.Allocation == nil {
				continue
			}
			r := mc.Status.Allocation.Devices.Results[0]
			sc, err := client.ResourceV1().ResourceClaims(ns).Get(ctx, smallClaim, metav1.GetOptions{})
			if err != nil {
				return err
			}
			sc.Status.Allocation = &resourceapi.AllocationResult{
				Devices:             resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{{Request: "gpus", Driver: r.Driver, Pool: r.Pool, Device: r.Device}}},
				NodeSelector:        mc.Status.Allocation.NodeSelector,
				AllocationTimestamp: &metav1.Time{Time: time.Now()},
			}
			sc.Status.ReservedFor = []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: small.Name, UID: small.UID}}
			if _, err := client.ResourceV1().ResourceClaims(ns).UpdateStatus(ctx, sc, metav1.UpdateOptions{}); err != nil {
				return err
			}
			p, err := client.CoreV1().Pods(ns).Get(ctx, small.Name, metav1.GetOptions{})
			if err != nil {
				return err
			}
			p.Spec.SchedulingGates = nil
			if _, err := client.CoreV1().Pods(ns).Update(ctx, p, metav1.UpdateOptions{}); err != nil {
				return err
			}
			err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
				p, err := client.CoreV1().Pods(ns).Get(ctx, small.Name, metav1.GetOptions{})
				return err == nil && p.Status.Phase == corev1.PodRunning, nil
			})
			if err != nil {
				return fmt.Errorf("the small pod did not run on %s/%s: %w", r.Pool, r.Device, err)
			}
			firstPlacement.Store(ptr.To(mc.Annotations[gangv1.AnnotationPlacement]))
			taken.Store(&r)
			return nil
		}
		return fmt.Errorf("no claim of rank 0 written")
	}
	var done atomic.Bool
	var takeErr atomic.Value
	e.restartController(t, func(step string) bool {
		if step == gang.StepBind && !done.Swap(true) {
			if err := take(); err != nil {
				takeErr.Store(err)
			}
		}
		return false
	})
	began := time.Now()
	e.trainJobGang(ctx, t, ns)
	return &doubleAllocation{small: small, smallClaim: smallClaim, first: first, taken: &taken, takeErr: &takeErr, began: began}
}

// refusedAtPrepare: a foreign allocator gives a small pod's claim the
// device the scheduler allocated to member 0. Forced here: at the bind step
// the test writes the small claim's allocation onto member 0's device and
// lets the small pod start, then the members bind. Member 0 is bound but the plugin refuses
// its prepare; after the grace the gang is evicted and placed again without
// that device, and no device is left allocated twice.
func (e gangEnv) refusedAtPrepare(ctx context.Context, t *testing.T) {
	const ns = "refused"
	d := e.raceForMemberZero(ctx, t, ns)
	client := e.c.Client()
	small, smallClaim, first, takeErr, began := d.small, d.smallClaim, d.first, d.takeErr, d.began

	// The gang runs again, whole, as a new placement.
	var second string
	var pods []corev1.Pod
	err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 3*time.Minute, true, func(context.Context) (bool, error) {
		if takeErr.Load() != nil {
			return true, nil
		}
		second = e.gs.get(ctx, t, ns, "train").Annotations[gangv1.AnnotationCommitted]
		list, err := client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: jobName + "=train"})
		if err != nil || first() == "" || second == "" || second == first() {
			return false, nil
		}
		pods = pods[:0]
		for _, p := range list.Items {
			if p.Status.Phase == corev1.PodRunning && p.DeletionTimestamp == nil && p.Annotations[gangv1.AnnotationPlacement] == second {
				pods = append(pods, p)
			}
		}
		return len(pods) == 4, nil
	})
	if err, _ := takeErr.Load().(error); err != nil {
		t.Fatalf("giving the small claim member 0's device: %v", err)
	}
	if err != nil {
		var b strings.Builder
		list, _ := client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		for _, p := range list.Items {
			fmt.Fprintf(&b, "  pod %s: %s node=%q placement=%q deleting=%v\n", p.Name, p.Status.Phase, p.Spec.NodeName, p.Annotations[gangv1.AnnotationPlacement], p.DeletionTimestamp != nil)
		}
		t.Fatalf("the gang was not placed again after member 0's prepare was refused (placement %q, was %q):\n%s%s\nevents:\n%s", second, first(), describeConditions(e.gs.get(ctx, t, ns, "train")), b.String(), e.c.events(ctx, ns))
	}
	recovered := time.Since(began)
	r := d.taken.Load()
	events := e.c.events(ctx, ns)
	if !e.c.hasEvent(ctx, ns, "train", gangv1.ReasonMemberLost) || !strings.Contains(events, "has not started") || !strings.Contains(events, "claim "+ns+"/"+smallClaim) {
		t.Errorf("no %s event saying member 0 has not started beside claim %s; events:\n%s", gangv1.ReasonMemberLost, smallClaim, events)
	}
	// No device stays allocated twice: the old member's claim goes with its
	// pod, the small pod keeps its device, the new placement avoids it.
	var twice string
	err = wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		list, err := client.ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		twice = ""
		held := map[string]string{}
		for _, c := range list.Items {
			if c.Status.Allocation == nil {
				continue
			}
			for _, res := range c.Status.Allocation.Devices.Results {
				key := res.Pool + "/" + res.Device
				if other, dup := held[key]; dup {
					twice += fmt.Sprintf(" %s (claims %s and %s)", key, other, c.Name)
				}
				held[key] = c.Name
			}
		}
		return twice == "" && held[r.Pool+"/"+r.Device] == smallClaim, nil
	})
	if err != nil {
		t.Errorf("devices allocated twice:%s; or the small claim lost %s/%s", twice, r.Pool, r.Device)
	}
	if p, err := client.CoreV1().Pods(ns).Get(ctx, small.Name, metav1.GetOptions{}); err != nil || p.Status.Phase != corev1.PodRunning {
		t.Errorf("the small pod no longer runs: %v", err)
	}
	t.Logf("the small claim took %s/%s of member 0 (placement %s); the gang runs again as placement %s on %v, %v after it was created",
		r.Pool, r.Device, first(), second, nodesOf(pods), recovered.Round(time.Second))
	e.restartController(t, nil)
}

// refusedThenFreed: as refusedAtPrepare, but the small pod is deleted once
// the plugin has refused member 0's prepare, so member 0's claim fits again
// before the grace ends. The kubelet would try member 0 again only at its
// next resync, at least its sync frequency (1m) after the refusal; the
// controller asks it at the end of the grace instead (prepare-retry, under
// the controller's admission policies), and the gang runs whole in its
// first placement, nothing evicted.
func (e gangEnv) refusedThenFreed(ctx context.Context, t *testing.T) {
	const ns = "freed"
	d := e.raceForMemberZero(ctx, t, ns)
	defer e.restartController(t, nil)
	client := e.c.Client()
	memberZero := func() *corev1.Pod {
		list, err := client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: jobName + "=train"})
		if err != nil || d.first() == "" {
			return nil
		}
		for i, p := range list.Items {
			if p.Annotations[gangv1.AnnotationPlacement] == d.first() && p.Annotations[gangv1.AnnotationRank] == "0" {
				return &list.Items[i]
			}
		}
		return nil
	}
	refused := func(pod string) bool {
		list, err := client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false
		}
		for _, ev := range list.Items {
			if ev.InvolvedObject.Kind == "Pod" && ev.InvolvedObject.Name == pod && ev.Reason == "FailedPrepareDynamicResources" {
				return true
			}
		}
		return false
	}
	eventually(ctx, t, 2*time.Minute, "member 0 refused at prepare", func() bool {
		p := memberZero()
		return d.takeErr.Load() != nil || p != nil && refused(p.Name)
	})
	if err, _ := d.takeErr.Load().(error); err != nil {
		t.Fatalf("giving the small claim member 0's device: %v", err)
	}
	e.c.deletePodsAndWait(ctx, t, d.small)
	freed := time.Now()

	// The gang runs whole in its first placement.
	eventually(ctx, t, 3*time.Minute, "the first placement's four members running", func() bool {
		list, err := client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: jobName + "=train"})
		if err != nil {
			return false
		}
		running := 0
		for _, p := range list.Items {
			if p.Annotations[gangv1.AnnotationPlacement] == d.first() && p.Status.Phase == corev1.PodRunning && p.DeletionTimestamp == nil {
				running++
			}
		}
		return running == 4
	})
	if id := e.gs.get(ctx, t, ns, "train").Annotations[gangv1.AnnotationCommitted]; id != d.first() {
		t.Errorf("the gang's placement is %q, want the first, %q, kept", id, d.first())
	}
	if e.c.hasEvent(ctx, ns, "train", gangv1.ReasonMemberLost) {
		t.Errorf("the gang lost a member although member 0's device was free again; events:\n%s", e.c.events(ctx, ns))
	}
	p := memberZero()
	var bound, started time.Time
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionTrue {
			bound = c.LastTransitionTime.Time
		}
	}
	for _, cs := range p.Status.ContainerStatuses {
		if cs.State.Running != nil {
			started = cs.State.Running.StartedAt.Time
		}
	}
	if bound.IsZero() || started.IsZero() {
		t.Fatalf("member 0 %s: no bind time or no running container in its status: %+v", p.Name, p.Status)
	}
	// The kubelet's own retry comes at least a sync frequency (1m) after
	// the refused prepare, which followed the bind.
	if took := started.Sub(bound); took >= time.Minute {
		t.Errorf("member 0 started %v after it was bound, no sooner than the kubelet's own resync: the controller did not have it prepared again (%s = %q)",
			took.Round(time.Second), gangv1.AnnotationPrepareRetry, p.Annotations[gangv1.AnnotationPrepareRetry])
	}
	if p.Annotations[gangv1.AnnotationPrepareRetry] == "" {
		t.Errorf("member 0 has no %s annotation", gangv1.AnnotationPrepareRetry)
	}
	t.Logf("member 0 %s: refused at prepare, its device freed %v after the gang was created; started %v after it was bound (grace %v), asked again at %s; placement %s kept",
		p.Name, freed.Sub(d.began).Round(time.Second), started.Sub(bound).Round(time.Second), unschedulableGrace, p.Annotations[gangv1.AnnotationPrepareRetry], d.first())
}

// selectorChangedMidPlacement: the controller dies after writing some of a
// gang's claims; before it comes back, the gang's selector changes so that
// it picks other pods (none here). The next leader rolls back what the cut
// placement wrote from its record on the gang, although the pods the claims
// were written for are no longer members: they stay gated, holding nothing.
func (e gangEnv) selectorChangedMidPlacement(ctx context.Context, t *testing.T) {
	const ns = "respec"
	e.setUp(ctx, t, ns)
	var reached atomic.Int32
	dying := e.restartController(t, func(step string) bool {
		return step == gang.StepClaimWritten && reached.Add(1) == 2
	})
	t.Cleanup(func() { e.gs.delete(context.WithoutCancel(ctx), t, ns, "g") })
	e.gs.create(ctx, t, labelGang(ns, "g", 4, "g-domain"))
	e.c.createMembers(ctx, t, ns, "g", "one-gpu", "g-domain", 4)
	select {
	case <-dying.done:
	case <-time.After(2 * time.Minute):
		t.Fatal("the controller was not interrupted")
	}
	allocated := e.c.cutPlacementWrote(ctx, t, ns, "g", "g-domain")
	gangs := e.gs.dyn.Resource(gangv1.GroupVersionResource).Namespace(ns)
	u, err := gangs.Get(ctx, "g", metav1.GetOptions{})
	noErr(t, err)
	noErr(t, unstructured.SetNestedStringMap(u.Object, map[string]string{"gang": "g-renamed"}, "spec", "selector", "matchLabels"))
	noErr(t, ok(gangs.Update(ctx, u, metav1.UpdateOptions{})))

	began := time.Now()
	*e.ctl = startController(e.parent, e.kubeconfig, "", nil)
	err = wait.PollUntilContextTimeout(ctx, 300*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		list, err := e.c.Client().ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		for _, c := range list.Items {
			if c.Status.Allocation != nil {
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		list, _ := e.c.Client().ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
		var b strings.Builder
		for _, c := range list.Items {
			fmt.Fprintf(&b, "  claim %s: allocated=%v placement=%q\n", c.Name, c.Status.Allocation != nil, c.Annotations[gangv1.AnnotationPlacement])
		}
		t.Fatalf("the claims the cut placement wrote are not freed after the gang's selector changed:\n%s%s", b.String(), describeConditions(e.gs.get(ctx, t, ns, "g")))
	}
	e.c.checkHeldNothing(ctx, t, ns, e.c.gangPods(ctx, t, ns, "g"), "g-domain")
	if !e.c.hasEvent(ctx, ns, "g", gangv1.ReasonRolledBack) {
		t.Errorf("no %s event on the gang; events:\n%s", gangv1.ReasonRolledBack, e.c.events(ctx, ns))
	}
	if _, ok := e.gs.get(ctx, t, ns, "g").Annotations[gangv1.AnnotationUncommitted]; ok {
		t.Errorf("the gang still records the rolled-back placement")
	}
	t.Logf("%d claims written before the crash; the domain claim freed %v after the controller came back, the selector no longer picking their pods", allocated, time.Since(began).Round(100*time.Millisecond))
	e.c.deleteGangAndMembers(ctx, t, e.gs, ns, "g")
}
