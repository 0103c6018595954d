package gang

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
)

// Each step of a look makes at most its cap of allocator calls, and a look
// at most its steps' caps together, however many pods wait: a reservation
// of twelve trays with forty pending pods of higher priority (each asking
// more GPUs than a tray has, so each is tried on every reserved tray) makes
// far more calls to yield than a cap of 150 uncapped; capped, no step makes
// more than 150, the look at most 150 for each of its steps, and it still
// reserves all twelve trays (the pods it did not get to are given nothing),
// its Waiting message saying which step was cut short. A cap the fit search
// alone exceeds fails the look, which keeps the gang's holds.
func TestALookMakesAtMostItsCapOfAllocatorCalls(t *testing.T) {
	const trayCount, podCount, capped = 12, 40, 150
	cliques := map[string]uint32{"a1": 1}
	var want []string
	for i := range trayCount {
		name := fmt.Sprintf("b%02d", i)
		cliques[name] = 2
		want = append(want, name)
	}
	snap, nodes := trays(t, cliques)
	f := newFakeCluster(t, snap, nodes)
	f.runningPod("forever-a1", "a1", 4, 0, startedAgo(time.Minute))
	for _, name := range want {
		f.runningPod("short-"+name, name, 4, 0, startedAgo(time.Minute), deadline(11*time.Minute))
	}
	f.prioGang("big", trayCount, 4, 0, nil)
	for i := range podCount {
		f.pendingPod(fmt.Sprintf("urgent-%02d", i), 5, 100)
	}

	g := f.reconcileOK("big")
	uncapped := f.r.allocatorCalls
	if pools := f.reservedPools("big"); !slices.Equal(pools, want) {
		t.Fatalf("uncapped: gang big taints pools %v, want %v", pools, want)
	}
	if n := f.r.allocatorStepCalls[stepYields]; n <= capped {
		t.Fatalf("an uncapped look made %d allocator calls to yield; the input is too small to test a cap of %d", n, capped)
	}
	if msg := conditionMessage(&g.Status, gangv1.ConditionWaiting); strings.Contains(msg, "short at its cap") {
		t.Errorf("uncapped: waiting: %s; no step was cut short", msg)
	}

	f.r.maxAllocatorCalls = capped
	g = f.reconcileOK("big")
	for step, n := range f.r.allocatorStepCalls {
		if n > capped || !slices.Contains(allocatorSteps, step) {
			t.Errorf("step %q of a look capped at %d a step made %d allocator calls", step, capped, n)
		}
	}
	if f.r.allocatorCalls > len(allocatorSteps)*capped {
		t.Errorf("a look capped at %d a step made %d allocator calls, more than its %d steps' caps", capped, f.r.allocatorCalls, len(allocatorSteps))
	}
	if pools := f.reservedPools("big"); !slices.Equal(pools, want) || g.Status.Reservation == nil {
		t.Errorf("capped: gang big taints pools %v (reservation %+v), want %v", pools, g.Status.Reservation, want)
	}
	if msg := conditionMessage(&g.Status, gangv1.ConditionWaiting); !strings.Contains(msg, "cut "+stepYields+" short at its cap of 150 allocator calls") {
		t.Errorf("capped: waiting: %s; want it to say the yields were cut short", msg)
	}
	t.Logf("allocator calls: %d uncapped, %d capped at %d a step (%v)", uncapped, f.r.allocatorCalls, capped, f.r.allocatorStepCalls)

	// A cap the fit search alone exceeds fails the look, which keeps the
	// reservation and its rules as they were.
	f.r.maxAllocatorCalls = 5
	if _, err := f.reconcile("ml", "big"); !errors.Is(err, errAllocatorCalls) {
		t.Fatalf("a look capped at 5 calls: %v, want %v", err, errAllocatorCalls)
	}
	if pools := f.reservedPools("big"); !slices.Equal(pools, want) || f.gang("ml", "big").Status.Reservation == nil {
		t.Errorf("after a look cut short: gang big taints pools %v, want %v kept", pools, want)
	}
}

// A preemption search that spends its whole budget of allocator calls
// leaves the reservation its own. Twenty domains full of one tenant's
// one-GPU pods, each domain's under a PodDisruptionBudget that lets one go
// at a time, make the preemption search fit the gang about forty times a
// domain and release nobody; the domain whose pods end in eleven minutes
// is still reserved, the look does not fail, and the gang's Waiting
// message says that the preemption search was cut short. With one budget
// shared by the steps, the reservation got no call on any look.
func TestAPreemptionThatSpendsItsBudgetLeavesTheReservationItsOwn(t *testing.T) {
	const per, domains = 8, 20
	cliques := map[string]uint32{}
	var want []string
	for j := range per {
		name := fmt.Sprintf("z-%d", j)
		cliques[name] = 999
		want = append(want, name)
	}
	for i := range domains {
		for j := range per {
			cliques[fmt.Sprintf("c%03d-%d", i, j)] = uint32(i + 1)
		}
	}
	snap, nodes := trays(t, cliques)
	f := newFakeCluster(t, snap, nodes)
	for name, clique := range cliques {
		if clique == 999 {
			f.runningPod("hi-"+name, name, 4, 100, startedAgo(time.Minute), deadline(11*time.Minute))
			continue
		}
		dom := fmt.Sprint(clique)
		for k := range 4 {
			f.runningPod(fmt.Sprintf("lo-%s-%d", name, k), name, 1, 0, startedAgo(time.Minute), func(p *v1.Pod, _ *resourceapi.ResourceClaim) {
				p.Labels["tenant-domain"] = dom
			})
		}
	}
	for i := range domains {
		f.create(&policyv1.PodDisruptionBudget{
			ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("pdb-%d", i+1), Namespace: "ml"},
			Spec:       policyv1.PodDisruptionBudgetSpec{Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"tenant-domain": fmt.Sprint(i + 1)}}},
			Status:     policyv1.PodDisruptionBudgetStatus{DisruptionsAllowed: 1},
		})
	}
	f.prioGang("big", per, 4, 10, nil)
	for look := range 2 {
		if _, err := f.reconcile("ml", "big"); err != nil {
			t.Fatalf("look %d failed (%d allocator calls): %v", look, f.r.allocatorCalls, err)
		}
		g := f.gang("ml", "big")
		if pools := f.reservedPools("big"); g.Status.Reservation == nil || !slices.Equal(pools, want) {
			t.Fatalf("look %d: reservation %+v, pools %v; want %v reserved", look, g.Status.Reservation, pools, want)
		}
		if len(f.evicted) != 0 {
			t.Fatalf("look %d: evicted %v; no budget allows a preemption", look, f.evicted)
		}
		if msg := conditionMessage(&g.Status, gangv1.ConditionWaiting); !strings.Contains(msg, "cut the preemption search short at its cap") || strings.Contains(msg, "reservation search short") {
			t.Errorf("look %d: waiting: %s; want it to say that the preemption search, and only it, was cut short", look, msg)
		}
		if f.r.allocatorCalls > maxAllocatorCallsPerLook {
			t.Errorf("look %d made %d allocator calls, more than a look's bound %d", look, f.r.allocatorCalls, maxAllocatorCallsPerLook)
		}
		t.Logf("look %d: %d allocator calls %v", look, f.r.allocatorCalls, f.r.allocatorStepCalls)
	}
}
