package gang

import (
	"slices"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
)

// A backfill pod whose eviction a PodDisruptionBudget never allows holds a
// started reservation for at most backfillRefusalGrace (five minutes).
// Until then the reservation waits for it on tray b1, never counting it
// gone, and the gang's status records when its eviction was first refused;
// once refused for longer, the pod is counted as staying: the reservation
// is recomputed without its GPU (tray a1, whose pod is expected to end in
// two hours), b1 is no longer tainted, the pod is no longer evicted, and a
// warning event and the gang's Waiting message name it.
func TestABackfillPodWhoseBudgetNeverAllowsHoldsAReservationAtMostAGrace(t *testing.T) {
	f := reservationCluster(t, -30*time.Second)
	f.refuseEvictions("bf-b1", 1<<30)
	f.prioGang("big", 4, 1, 0, nil)
	for look := range 3 {
		g := f.reconcileOK("big")
		r := g.Status.Reservation
		if r == nil || !slices.Equal(r.Nodes, []string{"b1"}) || !slices.Contains(r.WaitingFor, "ml/bf-b1") || len(f.evicted) != 0 {
			t.Fatalf("look %d: reservation %+v, evicted %v; want b1 waiting for the backfill pod whose eviction was refused", look, r, f.evicted)
		}
	}
	g := f.gang("ml", "big")
	if len(g.Status.BackfillRefusals) != 1 || g.Status.BackfillRefusals[0].Pod != "ml/bf-b1" {
		t.Errorf("refusals recorded: %+v; want ml/bf-b1 once", g.Status.BackfillRefusals)
	}
	// The first refusal was more than the grace (5 min) ago.
	g.Status.BackfillRefusals = []gangv1.BackfillRefusal{{Pod: "ml/bf-b1", Since: metav1.NewTime(time.Now().Add(-5*time.Minute - 2*time.Second))}}
	if _, err := f.r.gangs.UpdateStatus(f.ctx, g); err != nil {
		t.Fatal(err)
	}
	f.drainEvents()
	for look := range 2 {
		g = f.reconcileOK("big")
		r := g.Status.Reservation
		if r == nil || !slices.Equal(r.Nodes, []string{"a1"}) || slices.Contains(r.WaitingFor, "ml/bf-b1") {
			t.Fatalf("look %d past the grace: reservation %+v; want a1, not waiting for ml/bf-b1", look, r)
		}
		if pools := f.reservedPools("big"); !slices.Equal(pools, []string{"a1"}) {
			t.Fatalf("look %d past the grace: gang big taints pools %v, want a1 alone", look, pools)
		}
		for _, rule := range f.taintRules() {
			if rule.Spec.Taint.Key != gangv1.TaintReserved {
				t.Errorf("look %d past the grace: rule %s taints with %s; a1 is reserved from two hours on, not started", look, rule.Name, rule.Spec.Taint.Key)
			}
		}
		if msg := conditionMessage(&g.Status, gangv1.ConditionWaiting); !strings.Contains(msg, "counted as staying") || !strings.Contains(msg, "ml/bf-b1") {
			t.Errorf("look %d past the grace: waiting: %s; want it to name ml/bf-b1 as staying", look, msg)
		}
		if len(f.evicted) != 0 {
			t.Errorf("look %d past the grace: evicted %v", look, f.evicted)
		}
		if look == 0 {
			if events := strings.Join(f.drainEvents(), "\n"); !strings.Contains(events, "Warning "+gangv1.ReasonBackfillEvictionRefused) || !strings.Contains(events, "ml/bf-b1") || !strings.Contains(events, "staying") {
				t.Errorf("events past the grace:\n%s", events)
			}
		}
	}
}
