package gang

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sort"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/dynamic-resource-allocation/resourceclaim"
	"k8s.io/klog/v2"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/driver/simulate"
)

// A reservation holds devices only against gangs and pods of lower or
// equal priority (reservationHolds): it keeps new pods off the nodes
// expected to free up first for a gang that may preempt nothing, and must
// not keep a more important workload from GPUs that are free now. The
// scheduler knows nothing of a reservation's priority (a DeviceTaintRule
// holds against every claim that does not tolerate it), so the controller
// takes its rules off the nodes such a workload needs:
//
//   - a gang it does not hold against is placed in its domain as if it
//     were not there (heldDomains), and the rules on the pools of that
//     gang's members go before they are released, and on each look until
//     the scheduler has allocated them (yieldToGang); the reserving gang
//     taints no node where a released member waits (reserve, v.pins);
//   - a pod of higher priority that the scheduler could not place and that
//     fits on a reserved node with the reservation gone, and on no node a
//     reservation does not hold, is given that node: the reservation
//     leaves it untainted (yieldToPods) until the pod is placed, for at
//     most yieldGrace, and to at most MaxReservationYields pods in all
//     (yieldBook); the pod's change queues the gang (Controller.podChanged),
//     and the reservation is recomputed around what the pod took.
//
// Nothing here allocates: deleting a rule only lets the scheduler's own
// allocator, with its own record of allocated devices, see more devices.

// maxYieldPods bounds the pending pods one look fits onto a reservation's
// nodes.
const maxYieldPods = 16

// yieldGrace is how long a node stays left to a pending pod that the
// scheduler has not placed: it retries the pod as soon as the rule goes
// (its ResourceSlice tracker reports the change), so a pod still not
// placed a minute later is kept out by something else, and the node is
// reserved again.
const yieldGrace = time.Minute

// yieldBook is a reservation's record of the pods it left nodes to
// (status.reservation.yields), carried from look to look while the
// reservation lasts. The bound on yields: each pod is given a node once,
// for at most yieldGrace while it is not placed, and at most
// MaxReservationYields pods are given one over the reservation's life; the
// next pods of higher priority wait for the gang, as pods of its priority
// do. Without it, a stream of such pods (or one that never schedules)
// would keep the gang's nodes from it for ever.
type yieldBook struct {
	now     time.Time
	records []gangv1.ReservationYield
	// granted are the yields given on this look.
	granted []gangv1.ReservationYield
	// refused name the pods that fit and were given nothing, and why.
	refused []string
}

// newYieldBook carries the yields of the reservation old (nil: none yet).
func newYieldBook(old *gangv1.Reservation, now time.Time) *yieldBook {
	b := &yieldBook{now: now}
	if old != nil {
		b.records = slices.Clone(old.Yields)
	}
	return b
}

// grant says whether pod p, which the reservation keeps out and which fits
// on node with it gone, is given the node on this look, and records a new
// yield.
func (b *yieldBook) grant(p *v1.Pod, node string) bool {
	key := p.Namespace + "/" + p.Name
	for _, y := range b.records {
		if y.Pod != key {
			continue
		}
		if b.now.Before(y.At.Add(yieldGrace)) {
			b.granted = append(b.granted, y)
			return true
		}
		b.refused = append(b.refused, fmt.Sprintf("%s (not placed within %s of its yield)", key, yieldGrace))
		return false
	}
	if len(b.records) >= gangv1.MaxReservationYields {
		b.refused = append(b.refused, fmt.Sprintf("%s (the reservation has left nodes to %d pods, its most)", key, len(b.records)))
		return false
	}
	y := gangv1.ReservationYield{Pod: key, Node: node, At: metav1.NewTime(b.now.Truncate(time.Second))}
	b.records = append(b.records, y)
	b.granted = append(b.granted, y)
	return true
}

// recheck is when the earliest yield given on this look runs out (0 when
// none was given): the reservation looks again then, to reserve the node
// again if its pod was not placed.
func (b *yieldBook) recheck() time.Duration {
	var d time.Duration
	for _, y := range b.granted {
		left := max(y.At.Add(yieldGrace).Sub(b.now), time.Second)
		if d == 0 || left < d {
			d = left
		}
	}
	return d
}

// yieldToPods finds, for the pending pods of higher priority than a
// reservation (priority) that the scheduler could not place, a node of the
// reservation (on, in order) each fits on with the reservation gone: its
// node selector, affinity and taints, the node's room, and its claims with
// the scheduler's allocator over snap (where the controller's live
// reservations are not applied, other rules are), each pod's devices taken
// before the next is fitted. It returns node -> the pods given it. Only a
// pod the reservation keeps out is given a node: one that fits on a node
// no reservation holds (held: this reservation's nodes and those of every
// live reservation's rules) is unschedulable for another reason (a
// condition not yet updated, or what the controller does not model: host
// ports, volumes, inter-pod affinity), and a node left to it would only
// let other pods take the reserved devices. A reservation holds nothing
// against the pods it does keep out (reservationHolds), within the bound
// grant keeps (yieldBook). Past the yields step's cap of allocator calls
// (maxAllocatorCallsPerStep) it stops, and the pods given a node so far
// keep it.
func (r *reconciler) yieldToPods(ctx context.Context, snap *simulate.Snapshot, nodes map[string]*v1.Node, pods []*v1.Pod, priority int32, on []string, held map[string]bool, grant func(*v1.Pod, string) bool) (map[string][]string, error) {
	var want []*v1.Pod
	backed := backedResources(snap.Classes)
	extended := map[*v1.Pod]map[string]int64{} // devices asked as extended resources, by class
	for _, p := range pods {
		if p.Spec.NodeName != "" || finished(p) || len(p.Spec.SchedulingGates) > 0 || podPriority(p) <= priority || !unschedulable(p) {
			continue
		}
		asked := backed.asked(p)
		if len(p.Spec.ResourceClaims) > 0 || len(asked) > 0 {
			want = append(want, p)
			extended[p] = asked
		}
	}
	if len(want) == 0 || len(on) == 0 {
		return nil, nil
	}
	sort.SliceStable(want, func(i, j int) bool {
		a, b := want[i], want[j]
		if podPriority(a) != podPriority(b) {
			return podPriority(a) > podPriority(b)
		}
		if !a.CreationTimestamp.Equal(&b.CreationTimestamp) {
			return a.CreationTimestamp.Before(&b.CreationTimestamp)
		}
		return a.Namespace+"/"+a.Name < b.Namespace+"/"+b.Name
	})
	if len(want) > maxYieldPods {
		want = want[:maxYieldPods]
	}
	byName := map[string]*resourceapi.ResourceClaim{}
	for _, c := range snap.Claims {
		byName[c.Namespace+"/"+c.Name] = c
	}
	cluster := snap.Cluster(nil, nil)
	room := newCapacity(nodes, pods)
	free := freeNodes(snap, r.driver, nodes, held)
	logger := klog.FromContext(ctx)
	out := map[string][]string{}
	for _, p := range want {
		var claims []*resourceapi.ResourceClaim
		if len(p.Spec.ResourceClaims) > 0 {
			var ok bool
			if claims, ok = unallocatedClaims(p, byName); !ok {
				continue
			}
		}
		// Devices asked as extended resources come through the claim the
		// scheduler would make for them, not through the node's room.
		req := requests(p)
		if asked := extended[p]; len(asked) > 0 {
			claims = append(claims, extendedClaim(p, asked))
			req = backed.without(req)
		}
		name, res, err := fitKeptOut(ctx, cluster, nodes, room, p, claims, req, on, free)
		if errors.Is(err, errAllocatorCalls) {
			// The pods given nodes so far keep them; the rest, not
			// proven kept out, wait for a look with calls to spare.
			logger.Info("Stopped fitting pending pods of higher priority onto the reservation's nodes at the look's cap of allocator calls", "fitted", len(out), "pod", klog.KObj(p))
			return out, nil
		}
		if err != nil {
			return nil, fmt.Errorf("fit pending pod %s/%s of priority %d: %w", p.Namespace, p.Name, podPriority(p), err)
		}
		if res == nil || !grant(p, name) {
			continue
		}
		cluster.Commit(res...)
		room.take(name, req)
		out[name] = append(out[name], fmt.Sprintf("%s/%s (priority %d)", p.Namespace, p.Name, podPriority(p)))
	}
	return out, nil
}

// fitKeptOut finds the first reserved node (of on) where pod p fits with
// the reservation gone and its claims' allocations there, not committed;
// "" and nil when it fits on none, or when it fits on a node no
// reservation holds (free) as well: the reservation is not what keeps it
// out.
func fitKeptOut(ctx context.Context, cluster *simulate.Cluster, nodes map[string]*v1.Node, room capacity, p *v1.Pod, claims []*resourceapi.ResourceClaim, req v1.ResourceList, on, free []string) (string, []resourceapi.AllocationResult, error) {
	name, res, err := fitOn(ctx, cluster, nodes, room, p, claims, req, on)
	if err != nil || res == nil {
		return "", nil, err
	}
	other, _, err := fitOn(ctx, cluster, nodes, room, p, claims, req, free)
	if err != nil {
		return "", nil, err
	}
	if other != "" {
		klog.FromContext(ctx).V(2).Info("A pending pod of higher priority fits where no reservation holds: the reservation does not keep it out, and leaves it no node", "pod", klog.KObj(p), "fitsOn", other)
		return "", nil, nil
	}
	return name, res, nil
}

// fitOn finds the first of names where pod p fits (fitted as yieldToPods
// says) and its claims' allocations there, not committed; "" and nil when
// it fits on none.
func fitOn(ctx context.Context, cluster *simulate.Cluster, nodes map[string]*v1.Node, room capacity, p *v1.Pod, claims []*resourceapi.ResourceClaim, req v1.ResourceList, names []string) (string, []resourceapi.AllocationResult, error) {
	for _, name := range names {
		n := nodes[name]
		if n == nil || !podFits(p, n) || room.fits(name, req) != "" {
			continue
		}
		res, err := allocate(ctx, cluster, n, claims...)
		if err != nil {
			return "", nil, fmt.Errorf("node %s: %w", name, err)
		}
		if res != nil {
			return name, res, nil
		}
	}
	return "", nil, nil
}

// freeNodes are the nodes with devices of driver (their own slices in
// snap) that no reservation holds (held) and that take new pods (not
// cordoned, not being deleted), by name.
func freeNodes(snap *simulate.Snapshot, driver string, nodes map[string]*v1.Node, held map[string]bool) []string {
	set := map[string]bool{}
	for _, s := range snap.Slices {
		if s.Spec.Driver != driver || s.Spec.NodeName == nil {
			continue
		}
		name := *s.Spec.NodeName
		if n := nodes[name]; n != nil && !held[name] && !n.Spec.Unschedulable && n.DeletionTimestamp == nil {
			set[name] = true
		}
	}
	return slices.Sorted(maps.Keys(set))
}

// heldNodes are the nodes reservations keep new pods off: own (the nodes
// of the reservation being made) and those of the pools of every rule
// placement models as a live gang's reservation (modelledRule).
func (r *reconciler) heldNodes(snap *simulate.Snapshot, own []string) (map[string]bool, error) {
	held := map[string]bool{}
	for _, n := range own {
		held[n] = true
	}
	if r.taintRules == nil {
		return held, nil
	}
	rules, err := r.taintRules.List(labels.Everything())
	if err != nil {
		return nil, fmt.Errorf("list the reservation rules: %w", err)
	}
	// modelledRule, with the gangs listed once.
	var reserving map[string]bool
	if r.allGangs != nil {
		reserving = map[string]bool{}
		for _, g := range r.allGangs() {
			if g.Status.Reservation != nil {
				reserving[string(g.UID)] = true
			}
		}
	}
	pools := map[string]bool{}
	for _, rule := range rules {
		sel := rule.Spec.DeviceSelector
		if sel == nil || sel.Pool == nil || !reservationRule(rule) || (reserving != nil && !reserving[rule.Labels[gangv1.LabelReservation]]) {
			continue
		}
		pools[*sel.Pool] = true
	}
	for _, s := range snap.Slices {
		if s.Spec.Driver == r.driver && s.Spec.NodeName != nil && pools[s.Spec.Pool.Name] {
			held[*s.Spec.NodeName] = true
		}
	}
	return held, nil
}

// unschedulable says whether the scheduler tried the pod and could not
// place it (PodScheduled False, Unschedulable).
func unschedulable(p *v1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == v1.PodScheduled {
			return c.Status == v1.ConditionFalse && c.Reason == v1.PodReasonUnschedulable
		}
	}
	return false
}

// unallocatedClaims are the pod's claims (byName: "<namespace>/<name>"),
// false when one is not there yet or is allocated already (the pod is not
// waiting for devices alone).
func unallocatedClaims(p *v1.Pod, byName map[string]*resourceapi.ResourceClaim) ([]*resourceapi.ResourceClaim, bool) {
	var out []*resourceapi.ResourceClaim
	for i := range p.Spec.ResourceClaims {
		name, _, err := resourceclaim.Name(p, &p.Spec.ResourceClaims[i])
		if err != nil || name == nil {
			return nil, false
		}
		c := byName[p.Namespace+"/"+*name]
		if c == nil || c.Status.Allocation != nil {
			return nil, false
		}
		out = append(out, c)
	}
	return out, len(out) > 0
}

// yieldToGang deletes the rules of other gangs' reservations that do not
// hold against gang g (of priority; reservationHolds) from the pools of
// nodes, where g's members are about to be released or wait for the
// scheduler to allocate them: placement leaves such reservations out
// (heldDomains lets g into their domains), but the scheduler knows nothing
// of priorities and would refuse the members. The rules are listed from
// the API server, so a rule created on the last look is not missed; pools
// maps the nodes to their pools, and is called only when some gang's
// reservation yields to g. The reserving gangs keep off those nodes while
// g's members wait (v.pins in reserve).
func (r *reconciler) yieldToGang(ctx context.Context, g *gangv1.Gang, priority int32, nodes []string, pools func([]string) (map[string]string, error)) error {
	if r.taintRules == nil || r.allGangs == nil || len(nodes) == 0 {
		return nil
	}
	yields := map[string]*gangv1.Gang{}
	for _, o := range r.allGangs() {
		if o.UID != g.UID && o.Status.Reservation != nil && !reservationHolds(o, g, priority) {
			yields[string(o.UID)] = o
		}
	}
	if len(yields) == 0 {
		return nil
	}
	list, err := r.client.ResourceV1().DeviceTaintRules().List(ctx, metav1.ListOptions{LabelSelector: gangv1.LabelReservation})
	if err != nil {
		return fmt.Errorf("list reservation rules before releasing gang %s/%s: %w", g.Namespace, g.Name, err)
	}
	var rules []*resourceapi.DeviceTaintRule
	for i := range list.Items {
		rule := &list.Items[i]
		if reservationRule(rule) && yields[rule.Labels[gangv1.LabelReservation]] != nil && rule.Spec.DeviceSelector != nil && rule.Spec.DeviceSelector.Pool != nil {
			rules = append(rules, rule)
		}
	}
	if len(rules) == 0 {
		return nil
	}
	byNode, err := pools(nodes)
	if err != nil {
		return err
	}
	want := map[string]bool{}
	for _, pool := range byNode {
		want[pool] = true
	}
	logger := klog.FromContext(ctx)
	for _, rule := range rules {
		if !want[*rule.Spec.DeviceSelector.Pool] {
			continue
		}
		o := yields[rule.Labels[gangv1.LabelReservation]]
		if err := r.client.ResourceV1().DeviceTaintRules().Delete(ctx, rule.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete rule %s of gang %s/%s's reservation (priority %d) before releasing gang %s/%s (priority %d) onto pool %s: %w",
				rule.Name, o.Namespace, o.Name, o.Status.Reservation.Priority, g.Namespace, g.Name, priority, *rule.Spec.DeviceSelector.Pool, err)
		}
		logger.Info("Reservation yields a pool to a gang it does not hold against", "pool", *rule.Spec.DeviceSelector.Pool, "rule", rule.Name, "reservedFor", klog.KObj(o), "reservedPriority", o.Status.Reservation.Priority, "priority", priority)
		r.recorder.Eventf(o, v1.EventTypeNormal, gangv1.ReasonReserved, "left pool %s to gang %s/%s (priority %d), placed there", *rule.Spec.DeviceSelector.Pool, g.Namespace, g.Name, priority)
	}
	return nil
}

// nodePools maps nodes to the pools of the driver's slices on them, read
// from the API server.
func (r *reconciler) nodePools(ctx context.Context, nodes []string) (map[string]string, error) {
	list, err := r.client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: resourceapi.ResourceSliceSelectorDriver + "=" + r.driver})
	if err != nil {
		return nil, fmt.Errorf("list the resource slices of driver %s: %w", r.driver, err)
	}
	snap := &simulate.Snapshot{}
	for i := range list.Items {
		snap.Slices = append(snap.Slices, &list.Items[i])
	}
	return poolsOf(snap, r.driver, nodes), nil
}
