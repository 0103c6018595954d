package gang

import (
	"slices"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
)

// everyTaint makes a pod's claim tolerate every taint (no key), as pods
// tolerate health taints.
func everyTaint(_ *v1.Pod, c *resourceapi.ResourceClaim) {
	c.Spec.Devices.Requests[0].Exactly.Tolerations = []resourceapi.DeviceToleration{{Operator: resourceapi.DeviceTolerationOpExists}}
}

// notStarted leaves the pod bound but not started (no start time), as a
// pod on a node whose kubelet never reports it.
func notStarted(p *v1.Pod, _ *resourceapi.ResourceClaim) { p.Status.StartTime = nil }

func edits(e ...func(*v1.Pod, *resourceapi.ResourceClaim)) []func(*v1.Pod, *resourceapi.ResourceClaim) {
	return e
}

// A declared runtime is its pod's owner's word, which nothing enforces. A
// pod that declares one second and keeps running (or that never starts, so
// that its second is always still ahead) gets no other pod evicted, look
// after look: backfill is evicted for a reservation only once the pods it
// waits for on the strength of a declaration have ended, or when an end
// that the kubelet enforces (activeDeadlineSeconds, from a start it
// reported: a pod that never started has none) comes by the start. The
// reservation still switches to its started key, so no new backfill pod
// comes meanwhile.
func TestADeclaredRuntimeAloneEvictsNoOtherPod(t *testing.T) {
	for _, tc := range []struct {
		name  string
		edits []func(*v1.Pod, *resourceapi.ResourceClaim)
	}{
		{"a pod started 20 s ago that declares 1 s", edits(startedAgo(20*time.Second), expectedRuntime("1s"))},
		{"a pod bound but never started that declares 1 s", edits(notStarted, expectedRuntime("1s"))},
		{"a pod bound but never started whose activeDeadlineSeconds is 1", edits(notStarted, deadline(time.Second))},
	} {
		t.Run(tc.name, func(t *testing.T) {
			snap, nodes := trays(t, map[string]uint32{"b1": 2})
			f := newFakeCluster(t, snap, nodes)
			f.runningPod("liar", "b1", 3, 0, tc.edits...)
			f.runningPod("bf-b1", "b1", 1, 0, startedAgo(time.Minute), backfillPod)
			f.prioGang("big", 4, 1, 0, nil)
			for look := range 3 {
				g := f.reconcileOK("big")
				if r := g.Status.Reservation; r == nil || !slices.Equal(r.Nodes, []string{"b1"}) || !slices.Equal(r.WaitingFor, []string{"ml/liar"}) {
					t.Fatalf("look %d: reservation %+v, want b1 waiting for the liar", look, r)
				}
				if len(f.evicted) != 0 {
					t.Fatalf("look %d: evicted %v while the pod the reservation waits for still runs, its end enforced by nothing", look, f.evicted)
				}
				if rules := f.taintRules(); len(rules) != 1 || rules[0].Spec.Taint.Key != gangv1.TaintReservationStarted {
					t.Errorf("look %d: rules %+v, want one tainting %s", look, rules, gangv1.TaintReservationStarted)
				}
			}
			// The liar ends: now the backfill pod goes.
			if err := f.client.CoreV1().Pods("ml").Delete(f.ctx, "liar", metav1.DeleteOptions{}); err != nil {
				t.Fatal(err)
			}
			f.freeClaimsOfGonePods()
			f.reconcileOK("big")
			if !slices.Equal(f.evicted, []string{"bf-b1"}) {
				t.Errorf("evicted %v once the pod waited for ended, want the backfill pod", f.evicted)
			}
		})
	}
}

// A pod whose claims tolerate every taint is not a backfill pod where it
// ran before the reservation (TestNoReservationCountsOnALiarOrOnAPodThatToleratesEverything).
// One that came onto a reserved tray afterwards got there only by
// tolerating the reservation's taint: it is evicted at the start like any
// backfill pod of no higher priority, so it cannot starve the gang. One of
// higher priority than the gang is not evicted: the reservation does not
// hold against it.
func TestAPodThatToleratesEverythingCannotStarveAReservation(t *testing.T) {
	for _, tc := range []struct {
		name     string
		priority int32
		evicted  bool
	}{
		{"of the gang's priority", 0, true},
		{"of higher priority", 100, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := reservationCluster(t, 10*time.Minute)
			first := f.reserveB1()
			// bf-b1 ends; a pod tolerating every taint takes its GPU.
			f.backfillEndsAndAPodTakesItsGPU("greedy", tc.priority, everyTaint)
			// Time passes: short-b1's deadline ended 30 s ago.
			f.shortB1Overran()
			g := f.reconcileOK("big")
			if got := slices.Contains(f.evicted, "greedy"); got != tc.evicted {
				t.Fatalf("greedy (priority %d) evicted: %v (evicted %v), want %v", tc.priority, got, f.evicted, tc.evicted)
			}
			if r := g.Status.Reservation; tc.evicted && (r == nil || r.Domain != first.Domain || !slices.Equal(r.Nodes, []string{"b1"}) || r.Start.After(time.Now())) {
				t.Errorf("reservation %+v, want b1 started", r)
			}
		})
	}
}

// scheduledAgo marks the pod bound d ago (its PodScheduled condition's
// last transition to True).
func scheduledAgo(d time.Duration) func(*v1.Pod, *resourceapi.ResourceClaim) {
	return func(p *v1.Pod, _ *resourceapi.ResourceClaim) {
		p.Status.Conditions = append(p.Status.Conditions, v1.PodCondition{Type: v1.PodScheduled, Status: v1.ConditionTrue, LastTransitionTime: metav1.NewTime(time.Now().Add(-d))})
	}
}

// createdAgo sets the pod's creation d ago.
func createdAgo(d time.Duration) func(*v1.Pod, *resourceapi.ResourceClaim) {
	return func(p *v1.Pod, _ *resourceapi.ResourceClaim) {
		p.CreationTimestamp = metav1.NewTime(time.Now().Add(-d))
	}
}

// Whether a pod came under a reservation is judged from when it got its
// devices (its claims' allocation, else its binding), not from when its
// kubelet reported it started: a pod tolerating every taint that was bound
// before the reservation, and whose start came after it (a slow kubelet),
// ran there first and keeps its GPU; one created before the reservation but
// allocated or bound after it, not yet started, came under it and is
// evicted at the start.
func TestAPodCameUnderAReservationWhenItWasScheduledNotWhenItStarted(t *testing.T) {
	for _, tc := range []struct {
		name  string
		edits []func(*v1.Pod, *resourceapi.ResourceClaim)
		// allocated, if set, is when the claim was allocated, from now
		// (its allocationTimestamp).
		allocated *time.Duration
		evicted   bool
	}{
		{name: "bound before the reservation, started after it", edits: edits(scheduledAgo(10*time.Minute), startedAgo(-2*time.Second))},
		{name: "created before the reservation, bound after it, not started", edits: edits(createdAgo(time.Hour), scheduledAgo(-2*time.Second), notStarted), evicted: true},
		{name: "created before the reservation, allocated after it, not started", edits: edits(createdAgo(time.Hour), notStarted), allocated: ptr.To(2 * time.Second), evicted: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := reservationCluster(t, 10*time.Minute)
			f.reserveB1()
			f.backfillEndsAndAPodTakesItsGPU("greedy", 0, append(edits(everyTaint), tc.edits...)...)
			if tc.allocated != nil {
				c := f.claim("ml", "greedy-gpu")
				c.Status.Allocation.AllocationTimestamp = ptr.To(metav1.NewTime(time.Now().Add(*tc.allocated)))
				if err := f.client.Tracker().Update(resourceapi.SchemeGroupVersion.WithResource("resourceclaims"), c, "ml"); err != nil {
					t.Fatal(err)
				}
			}
			f.shortB1Overran()
			f.reconcileOK("big")
			if got := slices.Contains(f.evicted, "greedy"); got != tc.evicted {
				t.Errorf("greedy evicted: %v (evicted %v), want %v", got, f.evicted, tc.evicted)
			}
		})
	}
}
