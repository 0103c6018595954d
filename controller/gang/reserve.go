package gang

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"maps"
	"slices"
	"sort"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/driver/simulate"
)

// Reservation with backfill. A gang that fits nowhere and may preempt
// nothing reserves the nodes of the domain expected to free up first for
// it: from the pods there that declare when they end (their
// activeDeadlineSeconds, or annotation gang.tessera.dev/expected-runtime),
// the controller finds the earliest moment the gang fits (the scheduler's
// allocator, with those pods gone), and taints the devices of the nodes it
// would use then (DeviceTaintRules, effect NoSchedule), so that new pods do
// not take what frees up. Backfill pods, whose claims tolerate the taint,
// may still run there; those running when the reservation starts are
// evicted, on the strength of ends that come (backfill.go). Gangs of no
// higher priority are kept out of the domain meanwhile
// (status.reservation); gangs and pods of higher priority are not, and the
// rules leave the nodes they need (yield.go). Like a placement, the reservation is
// recomputed from the API on every look: a crash at any step leaves rules
// that the next look keeps or deletes.

// reservationRule says whether a DeviceTaintRule is one of the controller's
// reservations: labelled LabelReservation and tainting with one of the two
// reservation keys. The slices that placement, the re-check before and
// after the writes, preemption and the reservation search see (List) carry
// the taints of every other rule, an administrator's maintenance drain as
// the scheduler applies it, but not these: a reservation is modelled once,
// by the controller itself. The gang it holds for is placed in it as if it
// were not there (handOff gives it to the members that tolerate it, or
// deletes it before they reach the scheduler); other gangs keep out of its
// domain by priority (heldDomains), from status.reservation; backfill is
// judged by reserveIn. As taints as well, a reservation would keep its own
// gang out and hold against gangs of higher priority, which heldDomains
// lets in (and whose members' way yieldToGang clears in the API).
func reservationRule(rule *resourceapi.DeviceTaintRule) bool {
	if _, ok := rule.Labels[gangv1.LabelReservation]; !ok {
		return false
	}
	return rule.Spec.Taint.Key == gangv1.TaintReserved || rule.Spec.Taint.Key == gangv1.TaintReservationStarted
}

// modelledRule says whether placement leaves rule out, modelling it
// itself: a reservation rule (reservationRule) whose label names a gang
// that exists and holds a reservation (status.reservation). Any other,
// such as the rule of a gang deleted without its finalizer (swept
// when the controller sees the delete, or at the next leader's start) or one that merely carries the label,
// is applied as the scheduler applies it: otherwise gangs would be planned
// onto devices the scheduler refuses them, again and again.
func (r *reconciler) modelledRule(rule *resourceapi.DeviceTaintRule) bool {
	if !reservationRule(rule) {
		return false
	}
	if r.allGangs == nil {
		return true
	}
	uid := rule.Labels[gangv1.LabelReservation]
	for _, g := range r.allGangs() {
		if string(g.UID) == uid && g.Status.Reservation != nil {
			return true
		}
	}
	return false
}

// reservationWaitCap bounds the pods listed in a reservation's status.
const reservationWaitCap = gangv1.MaxPreemptionVictims

// reservation is where and from when a gang can be placed once the pods
// expected to end have.
type reservation struct {
	domain string
	start  time.Time
	// nodes are the nodes the gang would use then.
	nodes []string
	// waitingFor are the pods expected to end by start.
	waitingFor []*v1.Pod
	// backfill are the backfill pods on the domain's nodes: those still
	// running on its nodes at the start are evicted.
	backfill []*v1.Pod
}

// reserveIn finds the earliest moment the gang (of priority and UID gang)
// fits in cand: the pods that declare their end go in the order they are
// expected to (a pod more than overrunGrace past its end is no longer
// expected to end), and backfill pods of no higher priority than the gang
// that declare none count as gone (they are evicted at the start). nil
// when the gang does not fit even once they all have.
//
// A pod of no higher priority that came onto a node after the gang's rule
// there (tainted: node -> when the rule was created, or since if later),
// and whose claims tolerate the rule's taint in any way, a toleration of
// every taint included, is backfill too: it got there only by tolerating
// the reservation. Members of placed gangs (placements: "<namespace>/<id>"
// of every committed placement) are not: the controller placed them there.
func (pr *preemptor) reserveIn(ctx context.Context, cand candidate, now, since time.Time, priority int32, gang types.UID, tainted map[string]time.Time, placements map[string]bool) (*reservation, error) {
	on := map[string]bool{}
	for _, n := range cand.nodes {
		on[n] = true
	}
	own := map[types.UID]bool{}
	for _, m := range pr.v.live {
		own[m.pod.UID] = true
	}
	res := &reservation{domain: cand.pool}
	type timed struct {
		pod *v1.Pod
		end time.Time
	}
	var ends []timed
	var always []unit
	for _, p := range pr.pods {
		if !on[p.Spec.NodeName] || own[p.UID] || finished(p) || len(pr.podClaims[p.UID]) == 0 {
			continue
		}
		evictable := podPriority(p) <= priority && !pr.staying[p.Namespace+"/"+p.Name] && (pr.backfill(p, gang) || pr.cameUnder(p, gang, since, tainted, placements))
		if evictable {
			res.backfill = append(res.backfill, p)
		}
		// A pod ends when it declares; a backfill pod that declares
		// nothing (or overran), or that came onto the reserved devices
		// since the reservation (arrivedAt), is gone at the start: it is
		// evicted then.
		if evictable && pr.arrivedAt(p).After(since) {
			always = append(always, unit{pods: []*v1.Pod{p}})
		} else if end, ok := expectedEnd(p, now); ok && now.Before(end.Add(overrunGrace)) {
			ends = append(ends, timed{p, end})
		} else if evictable {
			always = append(always, unit{pods: []*v1.Pod{p}})
		}
	}
	sort.SliceStable(ends, func(i, j int) bool { return ends[i].end.Before(ends[j].end) })
	gone := func(k int) []unit {
		us := slices.Clone(always)
		for _, e := range ends[:k] {
			us = append(us, unit{pods: []*v1.Pod{e.pod}})
		}
		return us
	}
	p, err := pr.plan(ctx, cand, gone(len(ends)))
	if err != nil || p == nil {
		return nil, err
	}
	// p is the plan with ends[:hi] gone; the shortest such prefix is found
	// by halving (more pods gone never fits less).
	lo, hi := 0, len(ends)
	for lo < hi {
		mid := (lo + hi) / 2
		q, err := pr.plan(ctx, cand, gone(mid))
		if err != nil {
			return nil, err
		}
		if q != nil {
			hi, p = mid, q
		} else {
			lo = mid + 1
		}
	}
	// The start is the last expected end (now, with none): stable from one
	// look to the next.
	res.start = now
	for i, e := range ends[:lo] {
		res.waitingFor = append(res.waitingFor, e.pod)
		if i == 0 || e.end.After(res.start) {
			res.start = e.end
		}
	}
	set := map[string]bool{}
	for _, n := range p.nodes {
		if n != "" && !set[n] {
			set[n] = true
			res.nodes = append(res.nodes, n)
		}
	}
	sort.Strings(res.nodes)
	return res, nil
}

// reserve looks for the domain where the gang can start first and holds it
// (see the package comment above). It returns false when no domain will fit
// it even once every pod that declares its end has ended.
func (r *reconciler) reserve(ctx context.Context, g *gangv1.Gang, v *view, snap *simulate.Snapshot, nodes map[string]*v1.Node, pods []*v1.Pod, st *gangv1.GangStatus, now time.Time) (bool, time.Duration, error) {
	priority, _ := gangPriority(v)
	pr := newPreemptor(snap, r.driver, nodes, pods, r.imex, v, now)
	old := g.Status.Reservation
	tainted, err := r.taintedSince(g, snap)
	if err != nil {
		return false, 0, err
	}
	placements := map[string]bool{}
	if r.allGangs != nil {
		for _, o := range r.allGangs() {
			if id := o.Annotations[gangv1.AnnotationCommitted]; id != "" {
				placements[o.Namespace+"/"+id] = true
			}
		}
	}
	// A backfill pod whose eviction a PodDisruptionBudget has refused for
	// longer than backfillRefusalGrace is counted as staying: the
	// reservation is recomputed without its devices (elsewhere, later, or
	// not at all), and says which pod's budget moved it.
	keepRefusals(st, pods)
	staying := stayingPods(st, now)
	pr.staying = map[string]bool{}
	for _, p := range staying {
		pr.staying[p] = true
		if old != nil && slices.Contains(old.WaitingFor, p) {
			r.recorder.Eventf(g, v1.EventTypeWarning, gangv1.ReasonBackfillEvictionRefused, "the eviction of backfill pod %s has been refused by a PodDisruptionBudget for over %v: the reservation counts it as staying and is recomputed without its devices", p, backfillRefusalGrace)
			klog.FromContext(ctx).Info("A backfill pod's eviction was refused past the grace; the reservation counts it as staying", "pod", p, "grace", backfillRefusalGrace)
		}
	}
	var best *reservation
	// The reservation's simulation and the yields each spend a budget of
	// their own (maxAllocatorCallsPerStep): a preemption search that spent
	// its own starves neither.
	search := allocatorStep(ctx, stepReservation)
	for _, c := range candidates(snap, r.driver, nodes) {
		if _, held := v.held[c.pool]; held {
			continue
		}
		since := now
		if old != nil && old.Domain == c.pool {
			since = old.Since.Time
		}
		res, err := pr.reserveIn(search, c, now, since, priority, g.UID, tainted, placements)
		if errors.Is(err, errAllocatorCalls) {
			// The earliest start among the domains tried stands (none:
			// the gang waits, and its Waiting message says why).
			found := ""
			if best != nil {
				found = best.domain
			}
			klog.FromContext(ctx).Info("Stopped comparing domains for the reservation at the step's cap of allocator calls", "domain", found, "next", c.pool)
			break
		}
		if err != nil {
			return false, 0, err
		}
		if res != nil && (best == nil || res.start.Before(best.start)) {
			best = res
		}
	}
	if best == nil {
		return false, 0, nil
	}
	// A reservation that started stays started (its backfill evicted),
	// whatever a later look expects.
	since := now
	if old != nil && old.Domain == best.domain {
		since = old.Since.Time
		if old.Start.Time.Before(best.start) && !old.Start.Time.After(now) {
			best.start = old.Start.Time
		}
	}
	// The reservation holds nothing against what outranks it or was placed
	// before it: nodes where a released member of a placement waits for
	// the scheduler to allocate its claims (a rule now would refuse it),
	// and nodes a pending pod of higher priority fits on only with the
	// reservation gone (and on no node a reservation does not hold), are
	// left untainted (and their backfill alone).
	yielded := map[string][]string{}
	for _, pn := range v.pins {
		if slices.Contains(best.nodes, pn.node) {
			yielded[pn.node] = append(yielded[pn.node], "the released member "+pn.pod.Namespace+"/"+pn.pod.Name)
		}
	}
	held, err := r.heldNodes(snap, best.nodes)
	if err != nil {
		return false, 0, err
	}
	book := newYieldBook(old, now)
	toPods, err := r.yieldToPods(allocatorStep(ctx, stepYields), snap, nodes, pods, priority, slices.DeleteFunc(slices.Clone(best.nodes), func(n string) bool { return yielded[n] != nil }), held, book.grant)
	if err != nil {
		return false, 0, err
	}
	for n, who := range toPods {
		yielded[n] = append(yielded[n], who...)
	}
	best.nodes = slices.DeleteFunc(best.nodes, func(n string) bool { return yielded[n] != nil })
	// Backfill pods are stopped ahead of the start by their grace period,
	// so that they have ended by then; from that moment the rules keep
	// new backfill pods off.
	lead := time.Second
	for _, p := range best.backfill {
		if slices.Contains(best.nodes, p.Spec.NodeName) {
			lead = max(lead, min(graceOf(p), maxBackfillGrace)+time.Second)
		}
	}
	stopping := !now.Before(best.start.Add(-lead))
	if err := r.syncReservationRules(ctx, g, poolsOf(snap, r.driver, best.nodes), stopping); err != nil {
		return false, 0, err
	}
	logger := klog.FromContext(ctx)
	// Backfill is evicted only on the strength of ends that come: the
	// kubelet's (activeDeadlineSeconds, enforced), or a backfill pod's own
	// eviction. A pod waited for on its declared runtime alone holds the
	// backfill until it has really ended: its owner's word evicts no one
	// else, however often it is given.
	var unsure []string
	for _, p := range best.waitingFor {
		if !enforced(p) && !(slices.Contains(best.backfill, p) && slices.Contains(best.nodes, p.Spec.NodeName)) {
			unsure = append(unsure, p.Namespace+"/"+p.Name)
		}
	}
	sort.Strings(unsure)
	var evicted, kept, refused []string
	if stopping && len(unsure) == 0 {
		evicted, kept, refused = r.evictBackfill(ctx, g, best)
		addRefusals(st, refused, now)
	}
	var waitingFor []string
	for _, p := range best.waitingFor {
		waitingFor = append(waitingFor, p.Namespace+"/"+p.Name)
	}
	sort.Strings(waitingFor)
	start := best.start.UTC().Format(time.RFC3339)
	msg := fmt.Sprintf("reserved %s of %s from %s, when the %d pods it waits for are expected to have ended", strings.Join(best.nodes, ", "), best.domain, start, len(waitingFor))
	switch {
	case !now.Before(best.start):
		msg = fmt.Sprintf("reservation of %s of %s started at %s; waiting for %d pods to end", strings.Join(best.nodes, ", "), best.domain, start, len(waitingFor))
	case stopping && len(unsure) > 0:
		msg = fmt.Sprintf("reservation of %s of %s starts at %s; waiting for %d pods to end", strings.Join(best.nodes, ", "), best.domain, start, len(waitingFor))
	case stopping:
		msg = fmt.Sprintf("reservation of %s of %s starts at %s: backfill stopped ahead by its grace period; waiting for %d pods to end", strings.Join(best.nodes, ", "), best.domain, start, len(waitingFor))
	}
	if stopping && len(unsure) > 0 {
		msg += fmt.Sprintf("; backfill runs on until %s ended (an end that rests on a declared runtime, or on a start not yet reported, evicts no one)", strings.Join(capped(unsure), ", "))
	}
	if len(evicted) > 0 {
		msg += fmt.Sprintf("; evicted %d backfill pods", len(evicted))
	}
	if len(kept) > 0 {
		msg += fmt.Sprintf("; the eviction of %d backfill pods was refused (a PodDisruptionBudget) or failed, so they keep their devices and are tried again (one refused for over %v is counted as staying): %s", len(kept), backfillRefusalGrace, strings.Join(capped(kept), ", "))
	}
	msg += stayingNote(st, now)
	if len(yielded) > 0 {
		var left []string
		for _, n := range slices.Sorted(maps.Keys(yielded)) {
			left = append(left, fmt.Sprintf("left %s to %s", n, strings.Join(capped(yielded[n]), ", ")))
		}
		msg += "; " + strings.Join(left, "; ")
	}
	if len(book.refused) > 0 {
		msg += fmt.Sprintf("; left no node to %s", strings.Join(capped(book.refused), ", "))
	}
	msg += cutNote(ctx)
	if old == nil || old.Domain != best.domain || !old.Start.Time.Equal(best.start.Truncate(time.Second)) || !slices.Equal(old.Nodes, best.nodes) {
		r.recorder.Event(g, v1.EventTypeNormal, gangv1.ReasonReserved, msg)
		logger.Info("Gang reserved the nodes expected to free up first", "domain", best.domain, "nodes", best.nodes, "start", start, "waitingFor", len(waitingFor))
	}
	if len(waitingFor) > reservationWaitCap {
		waitingFor = waitingFor[:reservationWaitCap]
	}
	st.Reservation = &gangv1.Reservation{Domain: best.domain, Priority: priority, Since: metav1.NewTime(since.Truncate(time.Second)), Start: metav1.NewTime(best.start.Truncate(time.Second)), Nodes: best.nodes, WaitingFor: waitingFor, Yields: book.records}
	waiting(st, g.Generation, gangv1.ReasonReserved, msg)
	r.metrics.attempt("reserved")
	after := 5 * time.Second
	if d := best.start.Add(-lead).Sub(now); d > 0 {
		after = d
	}
	if d := book.recheck(); d > 0 && d < after {
		after = d
	}
	return true, after, nil
}

// evictBackfill evicts the backfill pods on the reservation's nodes, at
// its start. A pod whose eviction the API server refuses (429: a
// PodDisruptionBudget allows no disruption now) or that fails otherwise
// keeps its devices: it joins the pods the reservation waits for (and is
// listed in status.reservation.waitingFor), a warning event on it says so,
// and the next look, seconds later since the start has come, tries again
// (a pod refused for longer than backfillRefusalGrace is counted as
// staying, and no longer backfill). It returns the pods evicted, the pods
// kept and, of those, the pods whose eviction was refused
// ("<namespace>/<name>").
func (r *reconciler) evictBackfill(ctx context.Context, g *gangv1.Gang, best *reservation) (evicted, kept, refused []string) {
	logger := klog.FromContext(ctx)
	for _, p := range best.backfill {
		if !slices.Contains(best.nodes, p.Spec.NodeName) {
			continue
		}
		err := evict(ctx, r.client, p)
		if err == nil {
			r.recorder.Eventf(p, v1.EventTypeNormal, gangv1.ReasonBackfillEvicted, "evicted: the reservation of gang %s/%s on %s starts at %s", g.Namespace, g.Name, p.Spec.NodeName, best.start.UTC().Format(time.RFC3339))
			r.metrics.backfillEviction("evicted")
			evicted = append(evicted, p.Namespace+"/"+p.Name)
			continue
		}
		result := "failed"
		if apierrors.IsTooManyRequests(err) {
			result = "refused"
			refused = append(refused, p.Namespace+"/"+p.Name)
		}
		logger.Info("A backfill pod's eviction at its reservation's start was not done; it keeps its devices and is tried again", "pod", klog.KObj(p), "result", result, "err", err)
		r.recorder.Eventf(p, v1.EventTypeWarning, gangv1.ReasonBackfillEvictionRefused, "eviction %s: the reservation of gang %s/%s on %s starts at %s and waits for this pod, trying again: %v", result, g.Namespace, g.Name, p.Spec.NodeName, best.start.UTC().Format(time.RFC3339), err)
		r.metrics.backfillEviction(result)
		kept = append(kept, p.Namespace+"/"+p.Name)
		if !slices.Contains(best.waitingFor, p) {
			best.waitingFor = append(best.waitingFor, p)
		}
	}
	return evicted, kept, refused
}

// capped lists at most five names, and how many more there are.
func capped(names []string) []string {
	const most = 5
	if len(names) <= most {
		return names
	}
	return append(slices.Clone(names[:most]), fmt.Sprintf("%d more", len(names)-most))
}

// maxBackfillGrace bounds how far ahead of a reservation's start backfill
// pods are stopped.
const maxBackfillGrace = 2 * time.Minute

// graceOf is the pod's termination grace period (the API's default, 30 s,
// when unset).
func graceOf(p *v1.Pod) time.Duration {
	if s := p.Spec.TerminationGracePeriodSeconds; s != nil {
		return time.Duration(*s) * time.Second
	}
	return 30 * time.Second
}

// poolsOf maps each node to the pool of the driver's slices on it.
func poolsOf(snap *simulate.Snapshot, driver string, nodes []string) map[string]string {
	want := map[string]bool{}
	for _, n := range nodes {
		want[n] = true
	}
	pools := map[string]string{}
	for _, s := range snap.Slices {
		if s.Spec.Driver == driver && s.Spec.NodeName != nil && want[*s.Spec.NodeName] {
			pools[*s.Spec.NodeName] = s.Spec.Pool.Name
		}
	}
	return pools
}

// ruleName names the reservation rule of a gang for a pool with a taint
// key.
func ruleName(g *gangv1.Gang, pool, key string) string {
	h := fnv.New32a()
	_, _ = h.Write([]byte(pool))
	_, _ = h.Write([]byte{0})
	_, _ = h.Write([]byte(key))
	return fmt.Sprintf("tessera-reserve-%s-%08x", g.UID, h.Sum32())
}

// taintKey is the key a reservation's rules taint with: TaintReserved,
// which backfill pods tolerate, until the start; TaintReservationStarted,
// which no pod tolerates, from then on, so that no backfill pod takes what
// the evicted ones free.
func taintKey(started bool) string {
	if started {
		return gangv1.TaintReservationStarted
	}
	return gangv1.TaintReserved
}

// syncReservationRules makes the gang's DeviceTaintRules taint exactly the
// devices of these pools (node -> pool); none deletes them all. It reads
// the informer's cache, which may lag a rule created on the last look;
// deleteReservationRules reads the API server.
func (r *reconciler) syncReservationRules(ctx context.Context, g *gangv1.Gang, pools map[string]string, started bool) error {
	if r.taintRules == nil {
		return nil
	}
	existing, err := r.taintRules.List(labels.SelectorFromSet(labels.Set{gangv1.LabelReservation: string(g.UID)}))
	if err != nil {
		return err
	}
	return r.applyReservationRules(ctx, g, pools, started, existing)
}

// deleteReservationRules deletes every rule of the gang the API server
// has: for a gang about to go (its finalizer), when a rule the cache has
// not seen yet would be left behind for good, and for a gang placed, whose
// members the scheduler could not allocate beside a rule left.
func (r *reconciler) deleteReservationRules(ctx context.Context, g *gangv1.Gang) error {
	if r.taintRules == nil {
		return nil
	}
	list, err := r.client.ResourceV1().DeviceTaintRules().List(ctx, metav1.ListOptions{LabelSelector: labels.SelectorFromSet(labels.Set{gangv1.LabelReservation: string(g.UID)}).String()})
	if err != nil {
		return fmt.Errorf("list the reservation rules of gang %s/%s: %w", g.Namespace, g.Name, err)
	}
	existing := make([]*resourceapi.DeviceTaintRule, len(list.Items))
	for i := range list.Items {
		existing[i] = &list.Items[i]
	}
	return r.applyReservationRules(ctx, g, nil, false, existing)
}

// taintedAt is when rule's pool was first tainted for its reservation: the
// time its taint carries over from the rule it replaced, else its creation.
func taintedAt(rule *resourceapi.DeviceTaintRule) time.Time {
	if t := rule.Spec.Taint.TimeAdded; t != nil && !t.IsZero() {
		return t.Time
	}
	return rule.CreationTimestamp.Time
}

// applyReservationRules creates the wanted rules missing, then deletes
// the existing ones not wanted (in that order, so that a pool changing
// taint is never untainted in between).
func (r *reconciler) applyReservationRules(ctx context.Context, g *gangv1.Gang, pools map[string]string, started bool, existing []*resourceapi.DeviceTaintRule) error {
	key := taintKey(started)
	want := map[string]string{}
	for _, pool := range pools {
		want[ruleName(g, pool, key)] = pool
	}
	rules := r.client.ResourceV1().DeviceTaintRules()
	have := map[string]bool{}
	// A rule replacing another on its pool (the switch to the started
	// key) keeps when the pool was first tainted, in its taint's
	// timeAdded: whether a pod came under the reservation is judged from
	// then (taintedSince), not from the switch.
	since := map[string]time.Time{}
	for _, rule := range existing {
		have[rule.Name] = true
		if sel := rule.Spec.DeviceSelector; sel != nil && sel.Pool != nil {
			if at, ok := since[*sel.Pool]; !ok || taintedAt(rule).Before(at) {
				since[*sel.Pool] = taintedAt(rule)
			}
		}
	}
	for name, pool := range want {
		if have[name] {
			continue
		}
		rule := &resourceapi.DeviceTaintRule{
			ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{gangv1.LabelReservation: string(g.UID)}},
			Spec: resourceapi.DeviceTaintRuleSpec{
				DeviceSelector: &resourceapi.DeviceTaintSelector{Driver: &r.driver, Pool: &pool},
				Taint:          resourceapi.DeviceTaint{Key: key, Value: string(g.UID), Effect: resourceapi.DeviceTaintEffectNoSchedule},
			},
		}
		if at, ok := since[pool]; ok && !at.IsZero() {
			rule.Spec.Taint.TimeAdded = &metav1.Time{Time: at}
		}
		if _, err := rules.Create(ctx, rule, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("reserve pool %s for gang %s/%s: %w", pool, g.Namespace, g.Name, err)
		}
	}
	for _, rule := range existing {
		if _, ok := want[rule.Name]; ok {
			continue
		}
		if err := rules.Delete(ctx, rule.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete reservation rule %s of gang %s/%s: %w", rule.Name, g.Namespace, g.Name, err)
		}
	}
	return nil
}

// A reservation's hand-off to its gang. The scheduler allocates the
// members' claims after their release, and a rule deleted at the release
// would let pods waiting for the same devices be allocated first (the
// scheduler's queue takes them by priority, then by when they last
// failed). Members whose every request tolerates TaintReservationStarted
// are allocated under it: the controller keeps the gang's rules, under that
// key, from the release until the scheduler has allocated every member, and
// nothing else can take the devices meanwhile. Members that do not tolerate
// it have the rules deleted at the release (docs/gang.md, "Reservations").

// handOff is called at the commit of gang g's placement of members in. It
// keeps g's reservation in st, its rules switched to the started key, when
// g holds one and every member tolerates that key; otherwise it deletes
// every rule of g the API server has (one the informer has not delivered
// yet included). It says whether the reservation is kept.
func (r *reconciler) handOff(ctx context.Context, g *gangv1.Gang, in []*member, st *gangv1.GangStatus) (bool, error) {
	if r.taintRules == nil {
		return false, nil
	}
	list, err := r.client.ResourceV1().DeviceTaintRules().List(ctx, metav1.ListOptions{LabelSelector: labels.SelectorFromSet(labels.Set{gangv1.LabelReservation: string(g.UID)}).String()})
	if err != nil {
		return false, fmt.Errorf("list the reservation rules of gang %s/%s: %w", g.Namespace, g.Name, err)
	}
	existing := make([]*resourceapi.DeviceTaintRule, len(list.Items))
	pools := map[string]string{}
	for i := range list.Items {
		existing[i] = &list.Items[i]
		if sel := list.Items[i].Spec.DeviceSelector; sel != nil && sel.Pool != nil {
			pools[*sel.Pool] = *sel.Pool
		}
	}
	keep := len(pools) > 0 && g.Status.Reservation != nil && membersTolerateStart(in)
	if !keep {
		pools = nil
	}
	if err := r.applyReservationRules(ctx, g, pools, true, existing); err != nil {
		return false, err
	}
	if keep {
		st.Reservation = g.Status.Reservation.DeepCopy()
	}
	return keep, nil
}

// handingOff keeps the reservation of a committed placement in st while
// its members are handed the devices (see handOff): until every member's
// claims are allocated, after which every rule of g is deleted.
func (r *reconciler) handingOff(ctx context.Context, g *gangv1.Gang, in []*member, st *gangv1.GangStatus) error {
	if g.Status.Reservation == nil {
		return nil
	}
	if !allAllocated(in) && membersTolerateStart(in) {
		st.Reservation = g.Status.Reservation.DeepCopy()
		return nil
	}
	return r.deleteReservationRules(ctx, g)
}

// membersTolerateStart says whether every request of every own claim of
// the members tolerates TaintReservationStarted (operator Exists, effect
// NoSchedule or any): the scheduler can then allocate them under their
// gang's started reservation.
func membersTolerateStart(in []*member) bool {
	tolerated := func(tols []resourceapi.DeviceToleration) bool {
		return slices.ContainsFunc(tols, func(t resourceapi.DeviceToleration) bool {
			return t.Key == gangv1.TaintReservationStarted && t.Operator == resourceapi.DeviceTolerationOpExists &&
				(t.Effect == "" || t.Effect == resourceapi.DeviceTaintEffectNoSchedule)
		})
	}
	for _, m := range in {
		for _, c := range m.claims {
			for _, req := range c.Spec.Devices.Requests {
				if req.Exactly != nil && !tolerated(req.Exactly.Tolerations) {
					return false
				}
				for _, sub := range req.FirstAvailable {
					if !tolerated(sub.Tolerations) {
						return false
					}
				}
			}
		}
	}
	return true
}
