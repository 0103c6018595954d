package gang

import (
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
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

// reserveB1 has gang big of reservationCluster reserve tray b1, the tray
// that frees up first, and returns the reservation.
func (f *fakeCluster) reserveB1() *gangv1.Reservation {
	f.t.Helper()
	f.prioGang("big", 4, 1, 0, nil)
	r := f.reconcileOK("big").Status.Reservation
	if r == nil || !slices.Equal(r.Nodes, []string{"b1"}) {
		f.t.Fatalf("reservation %+v, want b1", r)
	}
	return r
}

// backfillEndsAndAPodTakesItsGPU: reservationCluster's backfill pod on b1
// ends and pod name, of priority, takes its GPU two seconds from now.
func (f *fakeCluster) backfillEndsAndAPodTakesItsGPU(name string, priority int32, edit ...func(*v1.Pod, *resourceapi.ResourceClaim)) {
	f.t.Helper()
	if err := f.client.CoreV1().Pods("ml").Delete(f.ctx, "bf-b1", metav1.DeleteOptions{}); err != nil {
		f.t.Fatal(err)
	}
	f.freeClaimsOfGonePods()
	f.runningPod(name, "b1", 1, priority, append([]func(*v1.Pod, *resourceapi.ResourceClaim){startedAgo(-2 * time.Second)}, edit...)...)
}

// shortB1Overran moves short-b1's start back by 30.5 minutes: its
// 30-minute deadline (or declared runtime) ended 30 s ago.
func (f *fakeCluster) shortB1Overran() {
	f.t.Helper()
	p := f.pod("ml", "short-b1")
	p.Status.StartTime = ptr.To(metav1.NewTime(time.Now().Add(-30*time.Minute - 30*time.Second)))
	if err := f.client.Tracker().Update(v1.SchemeGroupVersion.WithResource("pods"), p, "ml"); err != nil {
		f.t.Fatal(err)
	}
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
	f := reservationCluster(t, -30*time.Second)
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
	// From the start no pod tolerates the taint: backfill pods do not take
	// what the evicted ones free.
	if rules := f.taintRules(); len(rules) != 1 || rules[0].Spec.Taint.Key != gangv1.TaintReservationStarted {
		t.Errorf("rules once started: %+v, want one tainting %s", rules, gangv1.TaintReservationStarted)
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
	if r == nil || !slices.Equal(r.WaitingFor, []string{"ml/bf-long"}) || time.Until(r.Start.Time) < 9*time.Minute {
		t.Fatalf("reservation %+v, want it to start when bf-long's deadline ends (10m)", r)
	}
	if len(f.evicted) != 0 {
		t.Errorf("evicted %v before the start", f.evicted)
	}
}

// A pod more than a minute past its declared end (its runtime was a lie, or
// its deadline is not enforced) no longer holds a reservation, and a pod
// that tolerates every taint (no key) is not a backfill pod: in either case
// tray b1 cannot be freed, and the gang reserves the tray whose pod ends in
// two hours instead.
func TestNoReservationCountsOnALiarOrOnAPodThatToleratesEverything(t *testing.T) {
	for _, tc := range []struct {
		name string
		ends time.Duration // of tray b1's three-GPU pod, from now
		all  bool          // b1's one-GPU pod tolerates every taint instead of the reservation's
	}{
		{"a pod two minutes past its declared end", -2 * time.Minute, false},
		{"a pod that tolerates every taint", 10 * time.Minute, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := reservationCluster(t, tc.ends)
			if tc.all {
				c := f.claim("ml", "bf-b1-gpu")
				c.Spec.Devices.Requests[0].Exactly.Tolerations = []resourceapi.DeviceToleration{{Operator: resourceapi.DeviceTolerationOpExists}}
				if _, err := f.client.ResourceV1().ResourceClaims("ml").Update(f.ctx, c, metav1.UpdateOptions{}); err != nil {
					t.Fatal(err)
				}
			}
			f.prioGang("big", 4, 1, 0, nil)
			g := f.reconcileOK("big")
			if r := g.Status.Reservation; r == nil || r.Domain != poolOf(1) || !slices.Equal(r.WaitingFor, []string{"ml/long-a1"}) {
				t.Fatalf("reservation %+v, want clique 1 (a1's pod ends in two hours)", r)
			}
			if len(f.evicted) != 0 {
				t.Errorf("evicted %v", f.evicted)
			}
		})
	}
}

// A backfill pod that comes onto the reserved devices after the reservation
// does not move its start, whatever end it declares: it is evicted at the
// start instead.
func TestABackfillPodArrivingAfterTheReservationDoesNotDelayIt(t *testing.T) {
	f := reservationCluster(t, 10*time.Minute)
	first := f.reserveB1()
	// bf-b1 ends; a new backfill pod with an hour's deadline takes its GPU.
	f.backfillEndsAndAPodTakesItsGPU("late", 0, deadline(time.Hour), backfillPod)
	r := f.reconcileOK("big").Status.Reservation
	if r == nil || !r.Start.Equal(&first.Start) || !r.Since.Equal(&first.Since) || !slices.Equal(r.Nodes, first.Nodes) {
		t.Fatalf("reservation after a backfill pod came: %+v, want it unchanged from %+v", r, first)
	}
}

// A look that fails (here the API server refuses to list slices) changes no
// hold: the reservation and its rule stay until a look succeeds.
func TestAFailedLookKeepsTheReservation(t *testing.T) {
	f := reservationCluster(t, 10*time.Minute)
	f.prioGang("big", 4, 1, 0, nil)
	before := f.reconcileOK("big").Status.Reservation
	if before == nil || len(f.taintRules()) != 1 {
		t.Fatalf("reservation %+v, rules %d", before, len(f.taintRules()))
	}
	f.client.PrependReactor("list", "resourceslices", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, errors.New("the API server is away")
	})
	if _, err := f.reconcile("ml", "big"); err == nil {
		t.Fatal("the look did not fail")
	}
	if after := f.gang("ml", "big").Status.Reservation; after == nil || !after.Start.Equal(&before.Start) {
		t.Errorf("reservation after a failed look: %+v, want %+v", after, before)
	}
	if len(f.taintRules()) != 1 {
		t.Errorf("rules after a failed look: %+v", f.taintRules())
	}
}

// At start, the leader deletes the reservation rules of gangs that are gone
// (a finalizer removed by hand, a gang deleted while no controller ran) and
// keeps those of live gangs.
func TestTheLeaderSweepsTheRulesOfGangsThatAreGone(t *testing.T) {
	f := reservationCluster(t, 10*time.Minute)
	f.prioGang("big", 4, 1, 0, nil)
	f.reconcileOK("big")
	orphan := f.taintRules()[0].DeepCopy()
	orphan.Name, orphan.ResourceVersion = "tessera-reserve-gone-1", ""
	orphan.Labels = map[string]string{gangv1.LabelReservation: "uid-gone"}
	// On tray b2, which is full anyway: placement models a rule whose gang
	// is gone as the taint the scheduler applies, so on b1 it would move
	// big's reservation before the sweep.
	orphan.Spec.DeviceSelector.Pool = ptr.To("b2")
	if _, err := f.client.ResourceV1().DeviceTaintRules().Create(f.ctx, orphan, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	unrelated := orphan.DeepCopy()
	unrelated.Name, unrelated.Labels = "an-administrators-rule", nil
	// On tray b2, which is full anyway: placement applies it.
	unrelated.Spec.DeviceSelector.Pool = ptr.To("b2")
	unrelated.Spec.Taint = resourceapi.DeviceTaint{Key: "example.com/maintenance", Effect: resourceapi.DeviceTaintEffectNoSchedule}
	if _, err := f.client.ResourceV1().DeviceTaintRules().Create(f.ctx, unrelated, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	f.reconcileOK("big") // refills the listers
	inf := cache.NewSharedIndexInformer(&cache.ListWatch{}, &unstructured.Unstructured{}, 0, cache.Indexers{})
	u, err := toUnstructured(f.gang("ml", "big"))
	if err != nil {
		t.Fatal(err)
	}
	if err := inf.GetStore().Add(u); err != nil {
		t.Fatal(err)
	}
	c := &Controller{r: f.r, gangInf: inf}
	if err := c.sweepReservationRules(f.ctx); err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, r := range f.taintRules() {
		names = append(names, r.Name)
	}
	sort.Strings(names)
	if want := []string{"an-administrators-rule", ruleName(f.gang("ml", "big"), "b1", gangv1.TaintReserved)}; !slices.Equal(names, want) {
		t.Errorf("rules after the sweep: %v, want %v", names, want)
	}
}

// Backfill pods are stopped ahead of the start by their grace period (30 s
// by default, plus a second), so that they have ended by then: a
// reservation starting in 20 s evicts them now, and from now on no pod
// tolerates its rules.
func TestBackfillPodsGetTheirGracePeriodBeforeTheStart(t *testing.T) {
	f := reservationCluster(t, 20*time.Second)
	f.prioGang("big", 4, 1, 0, nil)
	g := f.reconcileOK("big")
	if r := g.Status.Reservation; r == nil || !slices.Equal(r.Nodes, []string{"b1"}) || !r.Start.After(time.Now()) {
		t.Fatalf("reservation %+v, want b1 starting in 20 s", r)
	}
	if !slices.Equal(f.evicted, []string{"bf-b1"}) {
		t.Errorf("evicted %v, want the backfill pod 20 s ahead of the start", f.evicted)
	}
	if rules := f.taintRules(); len(rules) != 1 || rules[0].Spec.Taint.Key != gangv1.TaintReservationStarted {
		t.Errorf("rules: %+v, want one tainting %s", rules, gangv1.TaintReservationStarted)
	}
}

// A pod's end counts from its start: one bound but not started yet (a queue
// of image pulls, a kubelet slow to report) runs its whole runtime from now
// at the earliest, not from its creation.
func TestExpectedEndCountsFromTheStart(t *testing.T) {
	now := time.Now()
	created := metav1.NewTime(now.Add(-10 * time.Minute))
	p := &v1.Pod{ObjectMeta: metav1.ObjectMeta{CreationTimestamp: created, Annotations: map[string]string{gangv1.AnnotationExpectedRuntime: "15m"}}}
	if end, ok := expectedEnd(p, now); !ok || !end.Equal(now.Add(15*time.Minute)) {
		t.Errorf("not started: end %v %v, want now+15m", end, ok)
	}
	p.Status.StartTime = ptr.To(metav1.NewTime(now.Add(-5 * time.Minute)))
	p.Spec.ActiveDeadlineSeconds = ptr.To[int64](600)
	if end, ok := expectedEnd(p, now); !ok || !end.Equal(now.Add(5*time.Minute)) {
		t.Errorf("started 5m ago, deadline 10m, runtime 15m: end %v %v, want now+5m", end, ok)
	}
	p.Annotations[gangv1.AnnotationExpectedRuntime] = "soon"
	p.Spec.ActiveDeadlineSeconds = nil
	if _, ok := expectedEnd(p, now); ok {
		t.Error("an unparsable runtime declares an end")
	}
}

// A reservation whose gang's members tolerate its started taint is handed
// over: its rule stays from the release until the scheduler has allocated
// every member (so nothing waiting for the same devices is allocated them
// first), and goes then. Members that do not tolerate it have it removed at
// the release (TestAReservationEvictsItsBackfillAtTheStartAndIsPlacedWhenFree).
func TestAReservationIsHandedToMembersThatTolerateIt(t *testing.T) {
	f := reservationCluster(t, -30*time.Second)
	f.prioGang("big", 4, 1, 0, nil)
	for i := range 4 {
		c := f.claim("ml", fmt.Sprintf("big-%d-gpu", i))
		c.Spec.Devices.Requests[0].Exactly.Tolerations = []resourceapi.DeviceToleration{{Key: gangv1.TaintReservationStarted, Operator: resourceapi.DeviceTolerationOpExists}}
		if err := f.client.Tracker().Update(resourceapi.SchemeGroupVersion.WithResource("resourceclaims"), c, "ml"); err != nil {
			t.Fatal(err)
		}
	}
	if g := f.reconcileOK("big"); g.Status.Reservation == nil {
		t.Fatal("not reserved")
	}
	if err := f.client.CoreV1().Pods("ml").Delete(f.ctx, "short-b1", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	f.freeClaimsOfGonePods()
	g := f.reconcileOK("big")
	if g.Annotations[gangv1.AnnotationCommitted] == "" || g.Status.Reservation == nil {
		t.Fatalf("placed %q with reservation %+v; want it placed and still reserved for the hand-over", g.Annotations[gangv1.AnnotationCommitted], g.Status.Reservation)
	}
	if rules := f.taintRules(); len(rules) != 1 || rules[0].Spec.Taint.Key != gangv1.TaintReservationStarted {
		t.Fatalf("rules at the release: %+v, want the started one kept", rules)
	}
	f.allocateReleased("big-0", "big-1", "big-2")
	if g = f.reconcileOK("big"); g.Status.Reservation == nil || len(f.taintRules()) != 1 {
		t.Fatalf("three of four members allocated: reservation %+v, rules %+v; want both kept", g.Status.Reservation, f.taintRules())
	}
	f.allocateReleased("big-3")
	if g = f.reconcileOK("big"); g.Status.Reservation != nil || len(f.taintRules()) != 0 {
		t.Fatalf("every member allocated: reservation %+v, rules %+v; want both gone", g.Status.Reservation, f.taintRules())
	}
}

// A gang deleted without its finalizer's cleanup (removed by hand) loses its
// reservation rules as soon as the controller sees it go, not at the next
// leader's start; a rule the last reconcile wrote that has not reached the
// cache goes too, and an administrator's rule stays.
func TestAGangGoneWithoutItsFinalizerLosesItsRulesAtOnce(t *testing.T) {
	f := reservationCluster(t, 10*time.Minute)
	f.prioGang("big", 4, 1, 0, nil)
	f.reconcileOK("big")
	rules := f.taintRules()
	if len(rules) != 1 {
		t.Fatalf("rules before: %d, want big's one", len(rules))
	}
	// Written for big, not yet in any cache.
	late := rules[0].DeepCopy()
	late.Name, late.ResourceVersion = "tessera-reserve-late", ""
	if _, err := f.client.ResourceV1().DeviceTaintRules().Create(f.ctx, late, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	admin := late.DeepCopy()
	admin.Name, admin.Labels = "an-administrators-rule", nil
	if _, err := f.client.ResourceV1().DeviceTaintRules().Create(f.ctx, admin, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	u, err := toUnstructured(f.gang("ml", "big"))
	if err != nil {
		t.Fatal(err)
	}
	// The gang is gone from the cache: its delete event arrives.
	c := &Controller{
		r:       f.r,
		gangInf: cache.NewSharedIndexInformer(&cache.ListWatch{}, &unstructured.Unstructured{}, 0, cache.Indexers{}),
		queue: workqueue.NewTypedRateLimitingQueue[string](
			workqueue.NewTypedItemExponentialFailureRateLimiter[string](time.Millisecond, time.Second)),
		members: map[string]gangv1.Members{},
	}
	defer c.queue.ShutDown()
	c.gangDeleted(u)
	if n := c.queue.Len(); n != 1 {
		t.Fatalf("queued after the delete: %d keys, want the sweep", n)
	}
	c.work(f.ctx)
	var names []string
	for _, r := range f.taintRules() {
		names = append(names, r.Name)
	}
	if want := []string{"an-administrators-rule"}; !slices.Equal(names, want) {
		t.Errorf("rules after the gang went: %v, want %v", names, want)
	}
}
