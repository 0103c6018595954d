package gang

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"

	"github.com/tessera-dev/tessera/driver/simulate"
)

// maxAllocatorCallsPerStep caps the calls of the scheduler's allocator
// each step of one look at a gang makes. A look has at most
// len(allocatorSteps) steps that call the allocator, run in that order when
// the one before finds nothing: the fit search (a growth's search
// included), preemption, the reservation's simulation over the domains
// (reserveIn) and the pending pods it may yield to (yieldToPods). Each has
// bounds of its own (maxYieldPods, maxReprieves, halving), but their
// product grows with what others create: pending pods, pods declaring
// ends, gangs, domains, PodDisruptionBudgets; without a cap, a user
// creating many of them could make every look of every gang spend minutes
// of CPU on the controller's one worker.
//
// Each step has a budget of its own, not a share of one: a step that
// spends its whole budget (preemption over many domains whose victims a
// PodDisruptionBudget will not release together costs about 40 gang fits
// a domain) leaves the next step its whole budget, and since the domains
// are tried in a fixed order, a shared budget would starve the same step
// on every look: a gang would never reserve, or keep a reservation frozen.
//
// Reasoning for the figure: one call costs 0.1–0.3 ms of a core (a GB200
// tray's GPU claim, measured in this package's fixtures on a shared
// two-core machine; docs/performance.md gives 40–175 µs on a DGX H100 and
// 1.4 ms with every slice of 500 MIG nodes), so a step's 5,000 calls are
// 0.5–1.5 s of one core and a whole look at most 4 × 5,000 = 20,000 calls,
// 2–6 s: a look never holds the worker much longer. An ordinary look needs
// far fewer: the fit search is linear in nodes plus members (about 600
// calls for 512 members on 64 nodes); a preemption fits its gang at most
// about 40 times per domain; a reservation halves over the ends of each
// domain's pods. A step that reaches its cap keeps what it found so far
// where that is safe (the pods already yielded to, the cheapest
// preemption and the earliest reservation among the domains tried), and
// the gang's Waiting message says so (cutNote); the fit search itself fails
// the look, which is retried with the queue's backoff and keeps the gang's
// holds (reconcile).
const maxAllocatorCallsPerStep = 5_000

// maxAllocatorCallsPerLook bounds the allocator calls of a whole look: each
// of its steps (allocatorSteps) at most its cap.
const maxAllocatorCallsPerLook = 4 * maxAllocatorCallsPerStep

// The steps of a look that call the allocator, each with a budget of its
// own (maxAllocatorCallsPerStep), named as the Waiting message names them.
const (
	stepSearch      = "the fit search"
	stepPreemption  = "the preemption search"
	stepReservation = "the reservation search"
	stepYields      = "the pending pods of higher priority the reservation may yield to"
)

// allocatorSteps are the steps of a look, in the order they run.
var allocatorSteps = []string{stepSearch, stepPreemption, stepReservation, stepYields}

// errAllocatorCalls is the error of an allocator call past a step's cap.
var errAllocatorCalls = errors.New("the look reached its cap of allocator calls")

// lookBudget counts one look's allocator calls, step by step, each step
// against its own cap.
type lookBudget struct {
	max   int64
	mu    sync.Mutex
	steps map[string]*stepBudget
	// cut are the steps that reached their cap, in the order they did.
	cut []string
}

// stepBudget counts one step's allocator calls against its cap.
type stepBudget struct {
	look  *lookBudget
	name  string
	spent atomic.Int64
}

type budgetKey struct{}

// withAllocatorBudget gives ctx a fresh look's budget of max allocator
// calls a step; calls made before any step is named (allocatorStep) count
// against the fit search's.
func withAllocatorBudget(ctx context.Context, max int) (context.Context, *lookBudget) {
	b := &lookBudget{max: int64(max), steps: map[string]*stepBudget{}}
	return context.WithValue(ctx, budgetKey{}, b.step(stepSearch)), b
}

// allocatorStep gives the calls made under the returned context the
// budget of the look's step name (the look's of ctx; none: ctx as is).
func allocatorStep(ctx context.Context, name string) context.Context {
	s, ok := ctx.Value(budgetKey{}).(*stepBudget)
	if !ok {
		return ctx
	}
	return context.WithValue(ctx, budgetKey{}, s.look.step(name))
}

// step is the budget of the step name, made on its first use.
func (b *lookBudget) step(name string) *stepBudget {
	b.mu.Lock()
	defer b.mu.Unlock()
	s, ok := b.steps[name]
	if !ok {
		s = &stepBudget{look: b, name: name}
		b.steps[name] = s
	}
	return s
}

// calls is how many allocator calls the look made: at most its cap for
// each step, so at most len(allocatorSteps) times the cap.
func (b *lookBudget) calls() int {
	total := 0
	for _, n := range b.stepCalls() {
		total += n
	}
	return total
}

// stepCalls is how many allocator calls each step of the look made.
func (b *lookBudget) stepCalls() map[string]int {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := map[string]int{}
	for name, s := range b.steps {
		if n := int(min(s.spent.Load(), b.max)); n > 0 {
			out[name] = n
		}
	}
	return out
}

// note records that step reached its cap.
func (s *stepBudget) note() {
	b := s.look
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, c := range b.cut {
		if c == s.name {
			return
		}
	}
	b.cut = append(b.cut, s.name)
}

// cutNote says, for the gang's Waiting message, which steps of the look in
// ctx reached their cap of allocator calls ("" when none did), starting
// with "; ".
func cutNote(ctx context.Context) string {
	s, ok := ctx.Value(budgetKey{}).(*stepBudget)
	if !ok {
		return ""
	}
	b := s.look
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.cut) == 0 {
		return ""
	}
	return fmt.Sprintf("; this look cut %s short at its cap of %d allocator calls (the best found among the domains tried stands)", strings.Join(b.cut, " and "), b.max)
}

// allocate runs the scheduler's allocator on node for claims (as
// cluster.AllocateOnNode), counted against the budget of the look's step
// in ctx (none: not counted); past the step's cap it returns
// errAllocatorCalls and calls nothing.
func allocate(ctx context.Context, cluster *simulate.Cluster, node *v1.Node, claims ...*resourceapi.ResourceClaim) ([]resourceapi.AllocationResult, error) {
	if s, ok := ctx.Value(budgetKey{}).(*stepBudget); ok && s.spent.Add(1) > s.look.max {
		s.note()
		return nil, fmt.Errorf("%w (%d in %s)", errAllocatorCalls, s.look.max, s.name)
	}
	return cluster.AllocateOnNode(ctx, node, claims...)
}
