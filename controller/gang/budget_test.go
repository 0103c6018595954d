package gang

import (
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"
)

// A look makes at most its cap of allocator calls, however many pods wait:
// a reservation of twelve trays with forty pending pods of higher priority
// (each asking more GPUs than a tray has, so each is tried on every
// reserved tray) makes far more calls than a cap of 150 uncapped; capped,
// it makes at most 150, and still reserves all twelve trays (the pods it
// did not get to are given nothing). A cap the fit search alone exceeds
// fails the look, which keeps the gang's holds.
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

	f.reconcileOK("big")
	uncapped := f.r.allocatorCalls
	if pools := f.reservedPools("big"); !slices.Equal(pools, want) {
		t.Fatalf("uncapped: gang big taints pools %v, want %v", pools, want)
	}
	if uncapped <= capped {
		t.Fatalf("an uncapped look made %d allocator calls; the input is too small to test a cap of %d", uncapped, capped)
	}

	f.r.maxAllocatorCalls = capped
	g := f.reconcileOK("big")
	if f.r.allocatorCalls > capped {
		t.Errorf("a look capped at %d made %d allocator calls", capped, f.r.allocatorCalls)
	}
	if pools := f.reservedPools("big"); !slices.Equal(pools, want) || g.Status.Reservation == nil {
		t.Errorf("capped: gang big taints pools %v (reservation %+v), want %v", pools, g.Status.Reservation, want)
	}
	t.Logf("allocator calls: %d uncapped, %d capped at %d", uncapped, f.r.allocatorCalls, capped)

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
