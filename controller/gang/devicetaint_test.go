package gang

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
)

// drainKey is the taint an administrator's maintenance rule sets.
const drainKey = "example.com/maintenance"

// drain is an administrator's DeviceTaintRule on every device of a node's
// pool: the tray is being drained for maintenance.
func drain(node string, effect resourceapi.DeviceTaintEffect) *resourceapi.DeviceTaintRule {
	return &resourceapi.DeviceTaintRule{
		ObjectMeta: metav1.ObjectMeta{Name: "drain-" + node},
		Spec: resourceapi.DeviceTaintRuleSpec{
			DeviceSelector: &resourceapi.DeviceTaintSelector{Driver: ptr.To(driver), Pool: ptr.To(node)},
			Taint:          resourceapi.DeviceTaint{Key: drainKey, Value: "tray", Effect: effect},
		},
	}
}

// tolerateDrain makes the members' own claims tolerate the drain.
func (f *fakeCluster) tolerateDrain(members ...string) {
	f.t.Helper()
	for _, m := range members {
		c := f.claim("ml", m+"-gpu")
		c.Spec.Devices.Requests[0].Exactly.Tolerations = []resourceapi.DeviceToleration{{Key: drainKey, Operator: resourceapi.DeviceTolerationOpExists}}
		if _, err := f.client.ResourceV1().ResourceClaims("ml").Update(f.ctx, c, metav1.UpdateOptions{}); err != nil {
			f.t.Fatal(err)
		}
	}
}

// A gang of four one-GPU members goes to the one-tray clique (tray a1)
// unless an administrator's DeviceTaintRule drains a1 (NoSchedule, or
// NoExecute, which the scheduler's allocator treats alike): then it goes
// to the other clique, as the scheduler would refuse a1's devices to the
// members. Members whose claims tolerate the drain still go to a1.
func TestAGangIsNotPlacedOnDevicesADeviceTaintRuleDrains(t *testing.T) {
	for _, tc := range []struct {
		name     string
		rule     *resourceapi.DeviceTaintRule
		tolerate bool
		want     string
	}{
		{name: "no rule", want: poolOf(1)},
		{name: "NoSchedule", rule: drain("a1", resourceapi.DeviceTaintEffectNoSchedule), want: poolOf(2)},
		{name: "NoExecute", rule: drain("a1", resourceapi.DeviceTaintEffectNoExecute), want: poolOf(2)},
		{name: "tolerated", rule: drain("a1", resourceapi.DeviceTaintEffectNoSchedule), tolerate: true, want: poolOf(1)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			snap, nodes := trays(t, map[string]uint32{"a1": 1, "b1": 2, "b2": 2})
			f := newFakeCluster(t, snap, nodes)
			if tc.rule != nil {
				f.create(tc.rule)
			}
			f.gangMembers(4)
			if tc.tolerate {
				f.tolerateDrain("m-0", "m-1", "m-2", "m-3")
			}
			if _, err := f.reconcile("ml", "g"); err != nil {
				t.Fatal(err)
			}
			g := f.gang("ml", "g")
			if g.Annotations[gangv1.AnnotationCommitted] == "" || !strings.HasPrefix(g.Status.Domain, tc.want) {
				t.Fatalf("gang in %q (%s), want placed in %s", g.Status.Domain, conditionMessage(&g.Status, gangv1.ConditionWaiting), tc.want)
			}
			for i := range 4 {
				node := pinnedTo(f.pod("ml", fmt.Sprintf("m-%d", i)))
				if drained := tc.rule != nil && !tc.tolerate && node == "a1"; drained || node == "" {
					t.Errorf("member m-%d pinned to %q", i, node)
				}
			}
		})
	}
}

// A gang that fits only with a drained tray's devices waits, and its
// message names the taint and the rule; it reserves nothing there. Once
// the rule is deleted, it is placed.
func TestAGangThatFitsOnlyOnDrainedDevicesWaitsNamingTheRule(t *testing.T) {
	snap, nodes := trays(t, map[string]uint32{"a1": 1, "b1": 2, "b2": 2})
	f := newFakeCluster(t, snap, nodes)
	f.create(drain("b1", resourceapi.DeviceTaintEffectNoSchedule))
	f.gangMembers(8) // only clique 2 (eight GPUs) can hold it
	if _, err := f.reconcile("ml", "g"); err != nil {
		t.Fatal(err)
	}
	g := f.gang("ml", "g")
	msg := conditionMessage(&g.Status, gangv1.ConditionWaiting)
	if g.Annotations[gangv1.AnnotationCommitted] != "" || waitingReason(g) != gangv1.ReasonNoDomainFits {
		t.Fatalf("gang placed in %q or waiting for %q (%s); tray b1 is drained", g.Status.Domain, waitingReason(g), msg)
	}
	if want := poolOf(2) + ": room for 4 of 8 members"; !strings.Contains(msg, want) {
		t.Errorf("message %q lacks %q", msg, want)
	}
	if want := "devices there carry taints its claims do not tolerate: " + drainKey + "=tray:NoSchedule (DeviceTaintRule drain-b1)"; !strings.Contains(msg, want) {
		t.Errorf("message %q lacks %q", msg, want)
	}
	if rules := f.taintRules(); len(rules) != 1 {
		t.Errorf("rules %+v: want the drain alone (no reservation)", rules)
	}

	if err := f.client.ResourceV1().DeviceTaintRules().Delete(f.ctx, "drain-b1", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := f.reconcile("ml", "g"); err != nil {
		t.Fatal(err)
	}
	if g := f.gang("ml", "g"); g.Annotations[gangv1.AnnotationCommitted] == "" || !strings.HasPrefix(g.Status.Domain, poolOf(2)) {
		t.Errorf("after the drain: gang in %q (%s), want placed in %s", g.Status.Domain, conditionMessage(&g.Status, gangv1.ConditionWaiting), poolOf(2))
	}
}

// The reservation search sees a drain too: tray b1, whose pod ends first,
// is drained, so the gang reserves tray a1 (two hours) rather than a tray
// the scheduler would not give it. Its own reservation rule, beside the
// administrator's, keeps it out of nothing.
func TestAReservationLeavesOutDrainedDevices(t *testing.T) {
	f := reservationCluster(t, 10*time.Minute)
	f.create(drain("b1", resourceapi.DeviceTaintEffectNoSchedule))
	f.prioGang("big", 4, 1, 0, nil)
	g := f.reconcileOK("big")
	r := g.Status.Reservation
	if waitingReason(g) != gangv1.ReasonReserved || r == nil || r.Domain != poolOf(1) || !slices.Equal(r.Nodes, []string{"a1"}) || !slices.Equal(r.WaitingFor, []string{"ml/long-a1"}) {
		t.Fatalf("waiting %q: %s, reservation %+v; want tray a1 reserved (b1 is drained)", waitingReason(g), conditionMessage(&g.Status, gangv1.ConditionWaiting), r)
	}
	var reservations int
	for _, rule := range f.taintRules() {
		if rule.Labels[gangv1.LabelReservation] != "" {
			reservations++
			if ptr.Deref(rule.Spec.DeviceSelector.Pool, "") != "a1" {
				t.Errorf("reservation rule %s taints pool %q, want a1", rule.Name, ptr.Deref(rule.Spec.DeviceSelector.Pool, ""))
			}
		}
	}
	if reservations != 1 {
		t.Errorf("%d reservation rules, want one for a1", reservations)
	}
	// Another look keeps it: the gang's own rule on a1 is not a drain.
	if g := f.reconcileOK("big"); g.Status.Reservation == nil || !slices.Equal(g.Status.Reservation.Nodes, []string{"a1"}) {
		t.Errorf("after another look: reservation %+v, want a1 kept", g.Status.Reservation)
	}
}

// reservationRule tells the controller's reservations (label and key)
// from every other rule, which placement applies.
func TestOnlyTheControllersReservationsAreLeftOutOfPlacement(t *testing.T) {
	labelled := map[string]string{gangv1.LabelReservation: "uid-1"}
	for _, tc := range []struct {
		labels map[string]string
		key    string
		want   bool
	}{
		{labelled, gangv1.TaintReserved, true},
		{labelled, gangv1.TaintReservationStarted, true},
		{nil, gangv1.TaintReserved, false},       // someone else's rule with the key
		{labelled, drainKey, false},              // a labelled rule of another key
		{nil, drainKey, false},                   // an administrator's drain
		{map[string]string{"x": "y"}, "", false}, // no taint key at all
	} {
		rule := &resourceapi.DeviceTaintRule{ObjectMeta: metav1.ObjectMeta{Labels: tc.labels}, Spec: resourceapi.DeviceTaintRuleSpec{Taint: resourceapi.DeviceTaint{Key: tc.key}}}
		if got := reservationRule(rule); got != tc.want {
			t.Errorf("labels %v key %q: reservation %v, want %v", tc.labels, tc.key, got, tc.want)
		}
	}
}

// The re-check of a plan before and after the writes (misfit) judges it on
// the snapshot's slices, drains applied, with each claim's tolerations: a
// claim planned on a drained device does not fit, one that tolerates the
// drain does.
func TestTheRecheckJudgesAPlanOnTheDrainedSlices(t *testing.T) {
	snap, nodes := trays(t, map[string]uint32{"a1": 1})
	f := newFakeCluster(t, snap, nodes)
	f.create(drain("a1", resourceapi.DeviceTaintEffectNoExecute))
	tainted, _, _, err := f.r.cluster(f.ctx, reservationRule)
	if err != nil {
		t.Fatal(err)
	}
	planned := func(tolerate bool) *resourceapi.ResourceClaim {
		c := newClaim("planned", "gpu.tessera.dev", 1)
		if tolerate {
			c.Spec.Devices.Requests[0].Exactly.Tolerations = []resourceapi.DeviceToleration{{Key: drainKey, Operator: resourceapi.DeviceTolerationOpExists}}
		}
		c.Status.Allocation = &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{
			{Request: "r", Driver: driver, Pool: "a1", Device: "gpu-0"},
		}}}
		return c
	}
	if why, err := misfit(f.ctx, tainted, nodes, []*resourceapi.ResourceClaim{planned(false)}); err != nil || why == "" {
		t.Errorf("a plan on drained a1/gpu-0: misfit %q, %v; want it not to fit", why, err)
	}
	if why, err := misfit(f.ctx, tainted, nodes, []*resourceapi.ResourceClaim{planned(true)}); err != nil || why != "" {
		t.Errorf("a plan tolerating the drain: misfit %q, %v; want it to fit", why, err)
	}
}

// A drain that comes after the scheduler allocated a member's claims takes
// nothing from them: NoSchedule keeps new claims off, the upstream eviction
// controller handles NoExecute, and the kubelet plugin prepares a tainted
// device it was allocated. A member slow to start there is not judged
// refused at prepare, so the gang is not evicted for it.
func TestADrainAfterTheAllocationDoesNotLoseABoundMember(t *testing.T) {
	snap, nodes := trays(t, map[string]uint32{"a1": 1})
	f := newFakeCluster(t, snap, nodes)
	f.placedGang(2 * time.Minute)
	f.create(drain("a1", resourceapi.DeviceTaintEffectNoSchedule))
	if _, err := f.reconcile("ml", "g"); err != nil {
		t.Fatal(err)
	}
	if len(f.evicted) != 0 {
		t.Errorf("evicted %v: a member allocated before the drain is not lost for it", f.evicted)
	}
	if g := f.gang("ml", "g"); g.Annotations[gangv1.AnnotationCommitted] == "" {
		t.Errorf("the placement was forgotten: %s", conditionMessage(&g.Status, gangv1.ConditionFailed))
	}
}

// Nor does a taint the node's plugin puts on the member's device after the
// allocation (a lazily published partition being withdrawn, a health
// taint of effect NoSchedule): it is in the slice itself, not a rule, and
// the re-check judges the member's claims as their holder.
func TestATaintOnTheSliceAfterTheAllocationDoesNotLoseABoundMember(t *testing.T) {
	snap, nodes := trays(t, map[string]uint32{"a1": 1})
	f := newFakeCluster(t, snap, nodes)
	f.placedGang(2 * time.Minute)
	list, err := f.client.ResourceV1().ResourceSlices().List(f.ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	tainted := 0
	for i := range list.Items {
		s := &list.Items[i]
		if s.Spec.Pool.Name != "a1" {
			continue
		}
		for j := range s.Spec.Devices {
			s.Spec.Devices[j].Taints = append(s.Spec.Devices[j].Taints, resourceapi.DeviceTaint{Key: "gpu.tessera.dev/partitions-withdrawn", Effect: resourceapi.DeviceTaintEffectNoSchedule})
			tainted++
		}
		if _, err := f.client.ResourceV1().ResourceSlices().Update(f.ctx, s, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	if tainted == 0 {
		t.Fatal("no device of a1 to taint")
	}
	if _, err := f.reconcile("ml", "g"); err != nil {
		t.Fatal(err)
	}
	if len(f.evicted) != 0 {
		t.Errorf("evicted %v: a member allocated before its device was tainted is not lost for it", f.evicted)
	}
}

// A reservation rule whose gang is gone (deleted without its finalizer;
// the leader sweeps such rules only when it starts), or that merely
// carries the reservation label, is no reservation the controller models:
// placement applies it as the scheduler does, and plans no member onto
// the devices it taints.
func TestARuleOfAGangThatIsGoneIsAppliedAsTheSchedulerDoes(t *testing.T) {
	snap, nodes := trays(t, map[string]uint32{"a1": 1, "b1": 2, "b2": 2})
	f := newFakeCluster(t, snap, nodes)
	orphan := drain("a1", resourceapi.DeviceTaintEffectNoSchedule)
	orphan.Name = "tessera-reserve-gone"
	orphan.Labels = map[string]string{gangv1.LabelReservation: "uid-gone"}
	orphan.Spec.Taint = resourceapi.DeviceTaint{Key: gangv1.TaintReserved, Value: "uid-gone", Effect: resourceapi.DeviceTaintEffectNoSchedule}
	f.create(orphan)
	f.gangMembers(4)
	if _, err := f.reconcile("ml", "g"); err != nil {
		t.Fatal(err)
	}
	for i := range 4 {
		if node := pinnedTo(f.pod("ml", fmt.Sprintf("m-%d", i))); node == "a1" {
			t.Errorf("member m-%d pinned to a1, whose devices the rule of a gang that is gone taints (the scheduler refuses it there)", i)
		}
	}
	if f.gang("ml", "g").Annotations[gangv1.AnnotationCommitted] == "" {
		t.Errorf("the gang was not placed on the other clique")
	}
}
