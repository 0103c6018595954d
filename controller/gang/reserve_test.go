package gang

import (
	"slices"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
)

// startedAgo sets a pod's start time.
func startedAgo(d time.Duration) func(*v1.Pod, *resourceapi.ResourceClaim) {
	return func(p *v1.Pod, _ *resourceapi.ResourceClaim) {
		p.Status.StartTime = ptr.To(metav1.NewTime(time.Now().Add(-d)))
	}
}

// deadline sets activeDeadlineSeconds.
func deadline(d time.Duration) func(*v1.Pod, *resourceapi.ResourceClaim) {
	return func(p *v1.Pod, _ *resourceapi.ResourceClaim) {
		p.Spec.ActiveDeadlineSeconds = ptr.To(int64(d.Seconds()))
	}
}

// expectedRuntime declares an expected runtime.
func expectedRuntime(d string) func(*v1.Pod, *resourceapi.ResourceClaim) {
	return func(p *v1.Pod, _ *resourceapi.ResourceClaim) {
		p.Annotations = map[string]string{gangv1.AnnotationExpectedRuntime: d}
	}
}

// backfillPod makes the pod's claim tolerate reservations.
func backfillPod(p *v1.Pod, c *resourceapi.ResourceClaim) {
	c.Spec.Devices.Requests[0].Exactly.Tolerations = []resourceapi.DeviceToleration{{Key: gangv1.TaintReserved, Operator: resourceapi.DeviceTolerationOpExists, Effect: resourceapi.DeviceTaintEffectNoSchedule}}
}

// reservationCluster: tray a1 (clique 1) holds a pod expected to run two
// hours; in clique 2, tray b1 holds a pod of three GPUs whose deadline ends
// at ends (from now) and a backfill pod of one GPU, and tray b2 a pod of
// four GPUs that declares no end. Everything has priority 0.
func reservationCluster(t *testing.T, ends time.Duration) *fakeCluster {
	snap, nodes := trays(t, map[string]uint32{"a1": 1, "b1": 2, "b2": 2})
	f := newFakeCluster(t, snap, nodes)
	f.runningPod("long-a1", "a1", 4, 0, startedAgo(time.Minute), expectedRuntime("2h"))
	f.runningPod("short-b1", "b1", 3, 0, startedAgo(20*time.Minute), deadline(20*time.Minute+ends))
	f.runningPod("bf-b1", "b1", 1, 0, startedAgo(time.Minute), backfillPod)
	f.runningPod("forever-b2", "b2", 4, 0, startedAgo(time.Minute))
	return f
}

func (f *fakeCluster) taintRules() []resourceapi.DeviceTaintRule {
	f.t.Helper()
	l, err := f.client.ResourceV1().DeviceTaintRules().List(f.ctx, metav1.ListOptions{})
	if err != nil {
		f.t.Fatal(err)
	}
	return l.Items
}

// A gang that fits nowhere, and may preempt nothing, reserves the nodes
// that free up first: tray b1, whose pod's deadline ends in ten minutes,
// not tray a1 (two hours) nor b2 (no end declared). The devices of b1 are
// tainted for new pods; the backfill pod there keeps running until the
// start. A gang of the same priority is kept out of the domain.
func TestAGangReservesTheNodesThatFreeUpFirst(t *testing.T) {
	f := reservationCluster(t, 10*time.Minute)
	f.prioGang("big", 4, 1, 0, nil)
	began := time.Now()
	res, err := f.reconcile("ml", "big")
	if err != nil {
		t.Fatal(err)
	}
	g := f.gang("ml", "big")
	r := g.Status.Reservation
	if waitingReason(g) != gangv1.ReasonReserved || r == nil || r.Domain != poolOf(2) || !slices.Equal(r.Nodes, []string{"b1"}) || !slices.Equal(r.WaitingFor, []string{"ml/short-b1"}) {
		t.Fatalf("waiting %q: %s, reservation %+v", waitingReason(g), conditionMessage(&g.Status, gangv1.ConditionWaiting), r)
	}
	if start := r.Start.Sub(began); start < 9*time.Minute || start > 11*time.Minute {
		t.Errorf("reservation starts in %v, want the short pod's deadline (10m)", start)
	}
	if res.requeueAfter < 9*time.Minute || res.requeueAfter > 11*time.Minute {
		t.Errorf("next look in %v, want at the start", res.requeueAfter)
	}
	rules := f.taintRules()
	if len(rules) != 1 {
		t.Fatalf("rules %+v, want one for tray b1's pool", rules)
	}
	rule := rules[0]
	if sel := rule.Spec.DeviceSelector; sel == nil || ptr.Deref(sel.Driver, "") != driver || ptr.Deref(sel.Pool, "") != "b1" || sel.Device != nil ||
		rule.Spec.Taint.Key != gangv1.TaintReserved || rule.Spec.Taint.Effect != resourceapi.DeviceTaintEffectNoSchedule || rule.Labels[gangv1.LabelReservation] != string(g.UID) {
		t.Errorf("rule %s: %+v labels %v", rule.Name, rule.Spec, rule.Labels)
	}
	if len(f.evicted) != 0 {
		t.Errorf("evicted %v before the reservation starts", f.evicted)
	}
	if events := strings.Join(f.drainEvents(), "\n"); !strings.Contains(events, gangv1.ReasonReserved+" reserved b1 of "+poolOf(2)) {
		t.Errorf("events:\n%s", events)
	}

	// Another look keeps the same rule; a gang of the same priority goes
	// elsewhere (clique 1, in two hours).
	f.reconcileOK("big")
	if again := f.taintRules(); len(again) != 1 || again[0].Name != rule.Name {
		t.Errorf("rules after another look: %+v", again)
	}
	f.prioGang("second", 1, 1, 0, nil)
	second := f.reconcileOK("second")
	if second.Status.Reservation == nil || second.Status.Reservation.Domain != poolOf(1) || !strings.Contains(conditionMessage(&second.Status, gangv1.ConditionWaiting), "reserved a1 of "+poolOf(1)) {
		t.Fatalf("second gang: reservation %+v: %s", second.Status.Reservation, conditionMessage(&second.Status, gangv1.ConditionWaiting))
	}
	if len(f.taintRules()) != 2 {
		t.Errorf("rules: %+v, want one per reserved tray", f.taintRules())
	}

	// Deleting the second gang removes its rule and keeps the first's.
	second = f.gang("ml", "second")
	second.DeletionTimestamp = ptr.To(metav1.Now()) // held by its finalizer
	if _, err := f.r.gangs.Update(f.ctx, second); err != nil {
		t.Fatal(err)
	}
	if _, err := f.reconcile("ml", "second"); err != nil {
		t.Fatal(err)
	}
	if left := f.taintRules(); len(left) != 1 || left[0].Name != rule.Name {
		t.Errorf("rules after the second gang's deletion: %+v", left)
	}
}

// When the reservation starts, the backfill pods on its nodes are evicted
// (not the pod it waits for, which overran its expected end); once the
// devices are free, the gang is placed there and the rules go.
func TestAReservationEvictsItsBackfillAtTheStartAndIsPlacedWhenFree(t *testing.T) {
	f := reservationCluster(t, -time.Minute)
	f.prioGang("big", 4, 1, 0, nil)
	g := f.reconcileOK("big")
	if r := g.Status.Reservation; r == nil || !slices.Equal(r.Nodes, []string{"b1"}) || r.Start.After(time.Now()) {
		t.Fatalf("reservation %+v, want b1 started", r)
	}
	if !slices.Equal(f.evicted, []string{"bf-b1"}) {
		t.Fatalf("evicted %v, want the backfill pod only", f.evicted)
	}
	if msg := conditionMessage(&g.Status, gangv1.ConditionWaiting); !strings.Contains(msg, "started") || !strings.Contains(msg, "evicted 1 backfill pods") {
		t.Errorf("waiting: %s", msg)
	}
	// The overrunning pod ends (its deadline), its claims are freed.
	if err := f.client.CoreV1().Pods("ml").Delete(f.ctx, "short-b1", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	f.freeClaimsOfGonePods()
	g = f.reconcileOK("big")
	if g.Annotations[gangv1.AnnotationCommitted] == "" || !strings.HasPrefix(g.Status.Domain, poolOf(2)) || g.Status.Reservation != nil {
		t.Fatalf("not placed in the reserved clique: domain %q, reservation %+v, %+v", g.Status.Domain, g.Status.Reservation, g.Status.Conditions)
	}
	if rules := f.taintRules(); len(rules) != 0 {
		t.Errorf("rules left after the placement: %+v", rules)
	}
}

// A backfill pod that declares its end is expected to end then, like any
// other: the reservation does not start early to evict it (one that
// declares nothing is counted gone at the start, and evicted then).
func TestABackfillPodThatDeclaresItsEndIsWaitedFor(t *testing.T) {
	snap, nodes := trays(t, map[string]uint32{"b1": 2})
	f := newFakeCluster(t, snap, nodes)
	f.runningPod("bf-long", "b1", 3, 0, startedAgo(time.Minute), deadline(11*time.Minute), backfillPod)
	f.prioGang("big", 4, 1, 0, nil)
	g := f.reconcileOK("big")
	r := g.Status.Reservation
	if r == nil || !slices.Equal(r.WaitingFor, []string{"ml/bf-long"}) || r.Start.Sub(time.Now()) < 9*time.Minute {
		t.Fatalf("reservation %+v, want it to start when bf-long's deadline ends (10m)", r)
	}
	if len(f.evicted) != 0 {
		t.Errorf("evicted %v before the start", f.evicted)
	}
}
