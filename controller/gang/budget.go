package gang

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"

	"github.com/tessera-dev/tessera/driver/simulate"
)

// maxAllocatorCallsPerLook caps the calls of the scheduler's allocator one
// look at a gang makes, across everything it decides: the fit search,
// preemption, the reservation's simulation (reserveIn) and the pods it may
// yield to (yieldToPods). Each of those has bounds of its own (maxYieldPods,
// maxReprieves, halving), but their product grows with what others create:
// pending pods, pods declaring ends, gangs, domains; without a total, a
// user creating many of them could make every look of every gang spend
// minutes of CPU on the controller's one worker.
//
// Reasoning for the figure: one call costs 0.1–0.3 ms of a core (a GB200
// tray's GPU claim, measured in this package's fixtures on a shared
// two-core machine; docs/performance.md gives 40–175 µs on a DGX H100 and
// 1.4 ms with every slice of 500 MIG nodes), so 10,000 calls are 1–3 s of
// one core, and a look never holds the worker much longer. An ordinary look
// needs far fewer: the fit search is linear in nodes plus members (about
// 600 calls for 512 members on 64 nodes); a preemption fits its gang at
// most about 40 times per domain. A look that reaches the cap keeps what it
// found so far where that is safe (the pods already yielded to, the
// cheapest preemption and the earliest reservation among the domains
// tried); the fit search itself fails the look, which is retried with the
// queue's backoff and keeps the gang's holds (reconcile).
const maxAllocatorCallsPerLook = 10_000

// errAllocatorCalls is the error of an allocator call past a look's cap.
var errAllocatorCalls = errors.New("the look reached its cap of allocator calls")

// allocatorBudget counts a look's allocator calls against its cap.
type allocatorBudget struct {
	max   int64
	spent atomic.Int64
}

type budgetKey struct{}

// withAllocatorBudget gives ctx a fresh budget of max allocator calls.
func withAllocatorBudget(ctx context.Context, max int) (context.Context, *allocatorBudget) {
	b := &allocatorBudget{max: int64(max)}
	return context.WithValue(ctx, budgetKey{}, b), b
}

// calls is how many allocator calls the look made (at most its cap).
func (b *allocatorBudget) calls() int {
	return int(min(b.spent.Load(), b.max))
}

// allocate runs the scheduler's allocator on node for claims (as
// cluster.AllocateOnNode), counted against the look's budget in ctx (none:
// not counted); past the cap it returns errAllocatorCalls and calls
// nothing.
func allocate(ctx context.Context, cluster *simulate.Cluster, node *v1.Node, claims ...*resourceapi.ResourceClaim) ([]resourceapi.AllocationResult, error) {
	if b, ok := ctx.Value(budgetKey{}).(*allocatorBudget); ok && b.spent.Add(1) > b.max {
		return nil, fmt.Errorf("%w (%d)", errAllocatorCalls, b.max)
	}
	return cluster.AllocateOnNode(ctx, node, claims...)
}
