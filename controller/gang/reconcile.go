package gang

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	policylisters "k8s.io/client-go/listers/policy/v1"
	resourcelisters "k8s.io/client-go/listers/resource/v1"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/driver/simulate"
)

// Steps at which Options.Interrupt may stop a placement, as a crash would.
const (
	StepClaimWritten = "claim-written" // after each claim is written (the domain claim's allocation, a member's annotations)
	StepCommit       = "commit"        // every claim written, before the commit mark
	StepRelease      = "release"       // committed, before any gate is released
	// StepBind: the scheduler has allocated every member's claims, before
	// the controller lets the members bind (bindTogether).
	StepBind = "bind"
)

// errInterrupted stops a placement at an Interrupt step without rollback.
var errInterrupted = errors.New("placement interrupted (test hook)")

// reconciler drives one gang at a time towards placed-and-running or held
// with nothing allocated. Everything it needs to resume is in the API: the
// gang's record of a placement being written and its committed-placement
// annotation, the placement and node annotations on each claim and released
// pod, the domain claim's allocation and its binding conditions.
type reconciler struct {
	client    kubernetes.Interface
	gangs     Client
	driver    string
	pods      corelisters.PodLister
	claims    resourcelisters.ResourceClaimLister
	nodes     corelisters.NodeLister
	recorder  record.EventRecorder
	interrupt func(step string) bool
	metrics   *Metrics
	// unschedulableGrace: see Options.UnschedulableGrace.
	unschedulableGrace time.Duration
	// imex and imexNamespace: see Options.IMEXDaemons, DaemonNamespace.
	imex          bool
	imexNamespace string
	// allGangs lists every gang (the informer's cache), for the domains
	// that gangs of higher priority hold while their preempted pods end.
	allGangs func() []*gangv1.Gang
	// taintRules lists DeviceTaintRules (the informer's cache), for the
	// rules of reservations.
	taintRules resourcelisters.DeviceTaintRuleLister
	// noReservations: see Options.NoReservations (and set when the API
	// server serves no DeviceTaintRules).
	noReservations bool
	// budgets lists PodDisruptionBudgets (the informer's cache).
	budgets policylisters.PodDisruptionBudgetLister
	// maxAllocatorCalls caps the allocator calls of each step of one look
	// (0: maxAllocatorCallsPerStep); allocatorCalls is what the last look
	// made in all, allocatorStepCalls what each of its steps made (one
	// look runs at a time).
	maxAllocatorCalls  int
	allocatorCalls     int
	allocatorStepCalls map[string]int
}

// result says when to look at a gang again (zero: on the next event).
type result struct{ requeueAfter time.Duration }

func (r *reconciler) reconcile(ctx context.Context, ns, name string) (result, error) {
	g, err := r.gangs.Get(ctx, ns, name)
	if apierrors.IsNotFound(err) {
		return result{}, nil
	}
	if err != nil {
		return result{}, err
	}
	logger := klog.LoggerWithValues(klog.FromContext(ctx), "gang", klog.KObj(g))
	ctx = klog.NewContext(ctx, logger)
	ctx, calls := withAllocatorBudget(ctx, cmp.Or(r.maxAllocatorCalls, maxAllocatorCallsPerStep))
	defer func() {
		r.allocatorCalls, r.allocatorStepCalls = calls.calls(), calls.stepCalls()
		logger.V(4).Info("Look done", "allocatorCalls", r.allocatorCalls)
	}()
	members, verr := gangv1.Validate(g)
	pods, err := r.pods.Pods(ns).List(labels.Everything())
	if err != nil {
		return result{}, err
	}
	v := observe(g, members, pods, r.getClaim)
	if g.DeletionTimestamp != nil {
		return result{}, r.finalize(ctx, g, v)
	}
	if !slices.Contains(g.Finalizers, gangv1.Finalizer) {
		g.Finalizers = append(g.Finalizers, gangv1.Finalizer)
		if g, err = r.gangs.Update(ctx, g); err != nil {
			return result{}, fmt.Errorf("add finalizer to gang %s/%s: %w", ns, name, err)
		}
	}
	old := g.Status.DeepCopy()
	st := g.Status.DeepCopy()
	st.ObservedGeneration = g.Generation
	st.Members = int32(len(v.live))
	st.Preemption = nil // only a look that preempts (or waits for its victims) sets it
	st.Reservation = nil
	res, err := r.step(ctx, g, v, verr, st)
	if errors.Is(err, errInterrupted) {
		return res, err
	}
	switch {
	case err != nil:
		// A failed look changes no hold: small pods would take what
		// the reservation kept for the gang.
		st.Reservation, st.Preemption = old.Reservation, old.Preemption
	case st.Reservation == nil:
		// Placed, preempting, or waiting for something no reservation
		// helps: the gang's rules go (none: only the informer is read).
		err = r.syncReservationRules(ctx, g, nil, false)
	}
	if statusChanged(old, st) {
		fresh, gerr := r.gangs.Get(ctx, ns, name)
		if gerr == nil {
			fresh.Status = *st
			_, gerr = r.gangs.UpdateStatus(ctx, fresh)
		}
		if gerr != nil && err == nil {
			err = fmt.Errorf("update status of gang %s/%s: %w", ns, name, gerr)
		}
	}
	return res, err
}

// step decides what the gang needs and does it, recording the outcome in st.
func (r *reconciler) step(ctx context.Context, g *gangv1.Gang, v *view, verr error, st *gangv1.GangStatus) (result, error) {
	// A placement cut short is undone from its record first, whatever the
	// spec says now: its claims may belong to pods that are no longer
	// members.
	rec, _ := recordOf(g)
	freed, recorded, err := r.rollBackRecorded(ctx, g)
	if err != nil {
		return result{requeueAfter: time.Second}, err
	}
	if freed > 0 {
		r.recorder.Eventf(g, v1.EventTypeNormal, gangv1.ReasonRolledBack, "rolled back a placement that was never committed: freed the %d claims it had written", freed)
	}
	if verr != nil {
		waiting(st, g.Generation, gangv1.ReasonInvalid, verr.Error())
		return result{}, nil
	}
	if recorded && rec.Growth {
		// The placement stands; only its growth was undone. The next
		// look grows it again.
		return result{requeueAfter: time.Second}, nil
	}
	if recorded {
		waiting(st, g.Generation, gangv1.ReasonPlacementPending, "rolled back a placement that was never committed; placing the gang afresh")
		return result{requeueAfter: time.Second}, nil
	}
	if id := g.Annotations[gangv1.AnnotationCommitted]; id != "" {
		done, res, err := r.committed(ctx, g, v, id, st)
		if done || err != nil {
			return res, err
		}
	}
	if busy, err := r.rollBack(ctx, g, v, st); busy || err != nil {
		return result{requeueAfter: time.Second}, err
	}
	least, most := gangv1.Bounds(&g.Spec)
	if reason, msg := roleCounts(g, v); reason != "" {
		waiting(st, g.Generation, reason, msg)
		return result{}, nil
	}
	switch {
	case v.invalid != "":
		waiting(st, g.Generation, gangv1.ReasonInvalid, v.invalid)
		return result{}, nil
	case len(v.live) < int(least) && v.elastic:
		waiting(st, g.Generation, gangv1.ReasonMembersMissing, fmt.Sprintf("%d of %d members exist; the gang is placed when its minimum (%d) do", len(v.live), most, least))
		return result{}, nil
	case len(v.live) < int(least):
		waiting(st, g.Generation, gangv1.ReasonMembersMissing, fmt.Sprintf("%d of %d members exist; the gang is placed when all do", len(v.live), least))
		return result{}, nil
	case len(v.live) > int(most):
		waiting(st, g.Generation, gangv1.ReasonTooManyMembers, fmt.Sprintf("%d pods are members (by spec.selector or spec.podGroupName), the gang has at most %d: make them exactly the gang's pods", len(v.live), most))
		return result{}, nil
	case v.pending != "":
		waiting(st, g.Generation, gangv1.ReasonClaimsPending, v.pending)
		return result{requeueAfter: 2 * time.Second}, nil
	}
	for _, m := range v.live {
		if !m.gated() {
			waiting(st, g.Generation, gangv1.ReasonInvalid, fmt.Sprintf("member %s has no scheduling gate %s, so the scheduler places it alone: create the gang's pods with the gate (in the Job's pod template)", m.ref(), gangv1.SchedulingGate))
			return result{}, nil
		}
	}
	if v.elastic && (g.Spec.PodGroupName != "" || g.Spec.CompositePodGroupName != "") {
		v.startWhole()
	}
	return r.place(ctx, g, v, st)
}

// place searches a domain for the whole gang and, if one fits, writes every
// claim, commits and releases every member.
func (r *reconciler) place(ctx context.Context, g *gangv1.Gang, v *view, st *gangv1.GangStatus) (result, error) {
	logger := klog.FromContext(ctx)
	began := time.Now()
	snap, nodes, pods, err := r.cluster(ctx, r.modelledRule)
	if err != nil {
		return result{}, err
	}
	if r.imex && v.domainClaim != nil {
		v.imexBusy = imexUnusable(snap.Claims, r.driver, v.domainClaim.UID, nodes)
	}
	r.holds(g, v)
	v.pins = pendingPins(pods, snap.Claims, v.has)
	p, verdicts, err := search(ctx, snap, r.driver, nodes, newCapacity(nodes, pods), v)
	if err != nil {
		return result{}, err
	}
	if p == nil {
		preempting, err := r.preempt(ctx, g, v, snap, nodes, pods, st)
		if err != nil {
			return result{}, err
		}
		if preempting {
			// Freed claims re-queue every gang; this is a safety net.
			return result{requeueAfter: 5 * time.Second}, nil
		}
		if !r.noReservations {
			reserved, after, err := r.reserve(ctx, g, v, snap, nodes, pods, st, time.Now())
			if err != nil {
				return result{}, err
			}
			if reserved {
				return result{requeueAfter: after}, nil
			}
		}
		msg := noFitMessage(len(v.live), verdicts)
		switch {
		case v.whole:
			msg = noFitMessageFor(len(v.live), fmt.Sprintf("all %d members (a PodGroup's gang starts with every pod it has: kube-scheduler binds none of a group's pods while one is gated)", len(v.live)), verdicts)
		case v.elastic:
			msg = noFitMessageFor(len(v.live), fmt.Sprintf("the minimum (%d) of the %d members", v.least, len(v.live)), verdicts)
		}
		msg += cutNote(ctx) + stayingNote(st, time.Now())
		if conditionMessage(st, gangv1.ConditionWaiting) != msg {
			r.recorder.Event(g, v1.EventTypeNormal, gangv1.ReasonNoDomainFits, msg)
			logger.V(2).Info("Gang does not fit", "why", msg)
		}
		waiting(st, g.Generation, gangv1.ReasonNoDomainFits, msg)
		r.metrics.attempt("nofit")
		return result{}, nil
	}
	ws := writes(g, v, p, nodes)
	// The scheduler goes on allocating while the search runs: check the plan
	// against the claims as they are now before writing anything. The
	// re-check after the writes undoes a double allocation, but the undoing
	// has a cost: the scheduler counts each allocated device once, so
	// clearing one of two claims that hold a device makes it forget the
	// other's hold and hand the device out again.
	if stale, err := conflicts(ctx, r.client, snap, nodes, planned(ws)); err != nil || stale != "" {
		if err != nil {
			return result{}, err
		}
		logger.V(2).Info("Placement taken before it was written", "domain", p.device(), "why", stale)
		waiting(st, g.Generation, gangv1.ReasonConflict, "placement found taken before it was written, retrying: "+stale)
		r.metrics.attempt("stale")
		return result{requeueAfter: time.Second}, nil
	}
	id := uuid.NewString()[:8]
	if g, err = r.recordPlacement(ctx, g, id, "", ws); err != nil {
		return result{}, err
	}
	written, err := r.writeClaims(ctx, g, id, ws)
	if errors.Is(err, errInterrupted) {
		return result{}, err
	}
	if err == nil && r.interrupt != nil && r.interrupt(StepCommit) {
		return result{}, errInterrupted
	}
	var conflict string
	if err == nil {
		conflict, err = conflicts(ctx, r.client, snap, nodes, written)
	}
	if err != nil || conflict != "" {
		_, _, rbErr := r.rollBackRecorded(ctx, g)
		why := conflict
		if err != nil {
			why = err.Error()
		}
		r.recorder.Event(g, v1.EventTypeWarning, gangv1.ReasonRolledBack, "placement in "+p.device()+" rolled back: "+why)
		waiting(st, g.Generation, gangv1.ReasonConflict, "placement rolled back, retrying: "+why)
		r.metrics.attempt("rolledback")
		return result{requeueAfter: time.Second}, errors.Join(rbErr)
	}
	recorded := g.DeepCopy()
	g.Annotations[gangv1.AnnotationCommitted] = id
	delete(g.Annotations, gangv1.AnnotationUncommitted)
	if _, err := r.gangs.Update(ctx, g); err != nil {
		_, _, rbErr := r.rollBackRecorded(ctx, recorded)
		return result{requeueAfter: time.Second}, errors.Join(fmt.Errorf("commit placement of gang %s/%s: %w", g.Namespace, g.Name, err), rbErr)
	}
	// A reservation is handed to the members (kept until the scheduler
	// has allocated them, if they tolerate it), or its rules go before
	// the members reach the scheduler: released members must not meet
	// their own reservation's taint. Committed: the next look hands it
	// over, then releases them (committed).
	if _, err := r.handOff(ctx, g, p.members, st); err != nil {
		return result{requeueAfter: time.Second}, fmt.Errorf("placed gang %s/%s, not released yet: %w", g.Namespace, g.Name, err)
	}
	// Reservations that do not hold against this gang leave the pools its
	// members go to before the scheduler sees them.
	priority, _ := gangPriority(v)
	yield := func() error {
		return r.yieldToGang(ctx, g, priority, p.nodes, func(nodes []string) (map[string]string, error) {
			return poolsOf(snap, r.driver, nodes), nil
		})
	}
	if err := r.releaseAll(ctx, p, id, yield); err != nil {
		return result{}, err // committed: the next reconcile releases the rest
	}
	notMet := spreadNotMet(gangv1.PlacementOf(&g.Spec), nodes, p.nodes)
	placed(st, g.Generation, p.device(), p.nodes, len(p.members), notMet)
	st.PlacedMembers = int32(len(p.members))
	msg := fmt.Sprintf("placed %d members in %s on %d nodes", len(p.members), p.device(), len(st.Nodes))
	if left := len(v.live) - len(p.members); left > 0 {
		msg += fmt.Sprintf("; %d more join when room appears there", left)
	}
	if notMet != "" {
		msg += "; " + notMet
	}
	r.recorder.Event(g, v1.EventTypeNormal, gangv1.ReasonPlaced, msg)
	logger.Info("Gang placed", "domain", p.device(), "members", len(p.members), "waiting", len(v.live)-len(p.members), "nodes", len(st.Nodes), "placement", id, "duration", time.Since(began).Round(time.Millisecond))
	r.metrics.attempt("placed")
	r.metrics.placed(time.Since(began))
	return result{}, nil
}

// placed records a placement in the status; notMet says how it misses a
// preferred placement policy ("" when it meets it).
func placed(st *gangv1.GangStatus, gen int64, device string, nodes []string, members int, notMet string) {
	set := map[string]bool{}
	for _, n := range nodes {
		if n != "" {
			set[n] = true
		}
	}
	st.Nodes = st.Nodes[:0]
	for n := range set {
		st.Nodes = append(st.Nodes, n)
	}
	sort.Strings(st.Nodes)
	st.Domain = device
	st.BackfillRefusals = nil
	setCondition(st, gen, gangv1.ConditionWaiting, false, gangv1.ReasonPlaced, "placed")
	if notMet != "" {
		setCondition(st, gen, gangv1.ConditionPlaced, true, gangv1.ReasonPolicyNotMet, fmt.Sprintf("%d members placed in %s; %s", members, device, notMet))
	} else {
		setCondition(st, gen, gangv1.ConditionPlaced, true, gangv1.ReasonPlaced, fmt.Sprintf("%d members placed in %s", members, device))
	}
	setCondition(st, gen, gangv1.ConditionFailed, false, gangv1.ReasonNone, "no member lost")
}

// committed handles a gang with a committed placement: it releases members a
// crash left gated, reports Placed and Running, or, when a member was lost,
// evicts the others and forgets the placement. done is false when the
// placement is gone and the gang is to be placed afresh.
func (r *reconciler) committed(ctx context.Context, g *gangv1.Gang, v *view, id string, st *gangv1.GangStatus) (done bool, _ result, _ error) {
	var in []*member
	for _, m := range v.live {
		if m.pod.Annotations[gangv1.AnnotationPlacement] == id || (m.gated() && claimsOf(m, id)) {
			in = append(in, m)
		}
	}
	var lost []string
	survivors := len(in)
	for _, p := range v.all {
		if p.Annotations[gangv1.AnnotationPlacement] != id || !finished(p) {
			continue
		}
		switch {
		case p.Status.Phase == v1.PodSucceeded && p.DeletionTimestamp == nil:
			survivors++
		case p.Status.Phase == v1.PodFailed:
			lost = append(lost, fmt.Sprintf("member %s failed", p.Name))
		default:
			lost = append(lost, fmt.Sprintf("member %s is being deleted", p.Name))
		}
	}
	shrunk := ""
	if v.elastic {
		// An elastic gang lets its lost members go while its minimums
		// live; the rest of it goes on untouched.
		if short := v.short(survivorsOf(in, v.all, v.roleNames, id)); short == "" {
			// Only news is reported: members fewer than at the last look
			// (PlacedMembers), or any loss when that count is unknown.
			if gone := st.PlacedMembers - int32(survivors); gone > 0 || (st.PlacedMembers == 0 && len(lost) > 0) {
				if gone > 0 {
					lost = append(lost, fmt.Sprintf("the placement lost %d members since the last look", gone))
				}
				shrunk = strings.Join(lost, "; ")
			}
			lost = nil
		} else if len(lost) == 0 {
			lost = append(lost, fmt.Sprintf("%d members of the placement live, %s (the others are gone: deleted, or their node left)", survivors, short))
		}
	} else if least, _ := gangv1.Bounds(&g.Spec); survivors < int(least) && len(lost) == 0 {
		lost = append(lost, fmt.Sprintf("%d of %d members of the placement are gone (deleted, or their node left)", int(least)-survivors, least))
	}
	var recheck time.Duration
	var who []*member
	if len(lost) == 0 {
		lost, who, recheck = r.stuck(in, time.Now())
	}
	if len(lost) == 0 {
		var again time.Duration
		var retry []*member
		var err error
		now := time.Now()
		if lost, who, retry, again, err = r.refused(ctx, in, now); err != nil {
			return true, result{requeueAfter: time.Second}, err
		}
		recheck = sooner(recheck, again)
		// Only a speed-up: a failed ask is logged, and the next look
		// asks again; the gang's repairs and status go on.
		every := min(prepareRetryAfter, r.unschedulableGrace)
		for _, m := range retry {
			if err := nudge(ctx, r.client, m, now, every); err != nil {
				klog.FromContext(ctx).Error(err, "Could not ask the kubelet to prepare a late member again", "pod", klog.KObj(m.pod))
				continue
			}
			klog.FromContext(ctx).Info("Asked the kubelet to prepare a late member again", "pod", klog.KObj(m.pod), "node", m.pod.Spec.NodeName)
		}
	}
	if len(lost) > 0 && v.elastic {
		// An elastic gang loses members stuck or refused alone while
		// its minimums live without them.
		rest := slices.DeleteFunc(slices.Clone(in), func(m *member) bool { return slices.Contains(who, m) })
		if v.short(survivorsOf(rest, v.all, v.roleNames, id)) == "" {
			if err := parallel(len(who), func(i int) error { return evict(ctx, r.client, who[i].pod) }); err != nil {
				return true, result{requeueAfter: time.Second}, err
			}
			shrunk = strings.Join(lost, "; ") + "; evicted alone"
			survivors -= len(in) - len(rest)
			in, lost = rest, nil
		}
	}
	if len(lost) == 0 {
		// Resume releasing members a crash left gated, once the
		// reservations that do not hold against the gang have left the
		// pools of every member not yet allocated (again on each look
		// until the scheduler has allocated them all).
		var gated []*member
		var waiting []string
		for _, m := range in {
			if m.gated() {
				gated = append(gated, m)
			}
			if !allAllocated([]*member{m}) {
				waiting = append(waiting, nodeOf(m, v))
			}
		}
		priority, _ := gangPriority(v)
		if err := r.yieldToGang(ctx, g, priority, waiting, func(nodes []string) (map[string]string, error) { return r.nodePools(ctx, nodes) }); err != nil {
			return true, result{requeueAfter: time.Second}, err
		}
		// The gang's own reservation is handed over (or its rules go)
		// before a gated member is released, as at the placement: a
		// crash, or a failed hand-off, may have left it in place.
		if len(gated) > 0 {
			if _, err := r.handOff(ctx, g, in, st); err != nil {
				return true, result{requeueAfter: time.Second}, err
			}
		}
		err := parallel(len(gated), func(i int) error {
			return release(ctx, r.client, gated[i], nodeOf(gated[i], v), id)
		})
		if err != nil {
			return true, result{}, err
		}
		if err := r.bindTogether(ctx, g, id, v.domainClaim, in); err != nil {
			return true, result{requeueAfter: time.Second}, err
		}
		if err := r.handingOff(ctx, g, in, st); err != nil {
			return true, result{requeueAfter: time.Second}, err
		}
		running := 0
		var nodes []string
		for _, m := range in {
			if m.pod.Status.Phase == v1.PodRunning {
				running++
			}
			if m.pod.Spec.NodeName != "" {
				nodes = append(nodes, m.pod.Spec.NodeName)
			}
		}
		device := st.Domain
		if device == "" {
			device = domainOf(v)
		}
		shrank := shrunkCondition(st)
		placed(st, g.Generation, device, nodes, len(in), r.spreadNotMet(g, nodes))
		st.PlacedMembers = int32(survivors)
		keepShrunk(g, st, shrank, survivors)
		if r.imex {
			r.imexStatus(g, v, st)
		}
		if running == len(in) {
			setCondition(st, g.Generation, gangv1.ConditionRunning, true, gangv1.ReasonRunning, fmt.Sprintf("all %d live members run", running))
		} else {
			setCondition(st, g.Generation, gangv1.ConditionRunning, false, gangv1.ReasonNotRunning, fmt.Sprintf("%d of %d live members run", running, len(in)))
		}
		if shrunk != "" {
			least, most := gangv1.Bounds(&g.Spec)
			msg := fmt.Sprintf("%s; the gang goes on with %d of at most %d members (at least %d)", shrunk, survivors, most, least)
			if conditionMessage(st, gangv1.ConditionFailed) != msg {
				r.recorder.Event(g, v1.EventTypeNormal, gangv1.ReasonShrunk, msg)
			}
			setCondition(st, g.Generation, gangv1.ConditionFailed, false, gangv1.ReasonShrunk, msg)
		}
		if v.elastic {
			res, err := r.grow(ctx, g, v, id, in, st)
			res.requeueAfter = sooner(res.requeueAfter, recheck)
			return true, res, err
		}
		return true, result{requeueAfter: recheck}, nil
	}
	// A member was lost: the gang cannot go on half. Evict the rest, free
	// the gated members' claims, and place the gang afresh once its
	// workload has recreated the members.
	msg := strings.Join(lost, "; ")
	if conditionMessage(st, gangv1.ConditionFailed) != msg {
		r.recorder.Event(g, v1.EventTypeWarning, gangv1.ReasonMemberLost, msg+"; evicting the other members and placing the gang again")
	}
	setCondition(st, g.Generation, gangv1.ConditionFailed, true, gangv1.ReasonMemberLost, msg)
	setCondition(st, g.Generation, gangv1.ConditionPlaced, false, gangv1.ReasonMemberLost, msg)
	setCondition(st, g.Generation, gangv1.ConditionRunning, false, gangv1.ReasonMemberLost, msg)
	setCondition(st, g.Generation, gangv1.ConditionWaiting, true, gangv1.ReasonMemberLost, "evicting the members of the lost placement")
	st.PlacedMembers = 0
	// Members waiting in the scheduler to bind give up first: none of them
	// starts. Gated members hold nothing (only the scheduler allocates
	// their claims, after their release).
	if err := failBinding(ctx, r.client, g, id, v.domainClaim, msg); err != nil {
		return true, result{requeueAfter: time.Second}, err
	}
	err := byRoleLastFirst(in, func(m *member) error {
		if m.gated() {
			return nil
		}
		return evict(ctx, r.client, m.pod)
	})
	if err != nil {
		return true, result{requeueAfter: time.Second}, err
	}
	delete(g.Annotations, gangv1.AnnotationCommitted)
	if _, err := r.gangs.Update(ctx, g); err != nil {
		return true, result{requeueAfter: time.Second}, fmt.Errorf("forget the lost placement of gang %s/%s: %w", g.Namespace, g.Name, err)
	}
	klog.FromContext(ctx).Info("Gang lost a member; evicted the others", "why", msg, "evicted", len(in))
	return true, result{requeueAfter: time.Second}, nil
}

// claimsOf says whether every claim of a gated member was written for
// placement id, with the member's node (so the member belongs to it).
func claimsOf(m *member, id string) bool {
	if len(m.claims) == 0 {
		return false
	}
	for _, c := range m.claims {
		if c.Annotations[gangv1.AnnotationPlacement] != id || c.Annotations[gangv1.AnnotationNode] == "" {
			return false
		}
	}
	return true
}

// nodeOf is the node of a member: where it is bound, else the node its
// placement chose (its claims' annotation), else where its claims were
// allocated.
func nodeOf(m *member, v *view) string {
	if m.pod.Spec.NodeName != "" {
		return m.pod.Spec.NodeName
	}
	for _, c := range m.claims {
		if n := c.Annotations[gangv1.AnnotationNode]; n != "" {
			return n
		}
	}
	for _, c := range m.claims {
		if c.Status.Allocation != nil {
			if n := nodeNameOf(c.Status.Allocation.NodeSelector); n != "" {
				return n
			}
		}
	}
	return ""
}

// domainOf names the domain device of the gang's domain claim.
func domainOf(v *view) string {
	if v.domainClaim == nil || v.domainClaim.Status.Allocation == nil || len(v.domainClaim.Status.Allocation.Devices.Results) == 0 {
		return ""
	}
	r := v.domainClaim.Status.Allocation.Devices.Results[0]
	return r.Pool + "/" + r.Device
}

func (r *reconciler) getClaim(ns, name string) (*resourceapi.ResourceClaim, error) {
	return r.claims.ResourceClaims(ns).Get(name)
}

// nodeNameOf is the node an allocation from a node's own slices is confined
// to (the allocator writes a metadata.name field requirement); "" otherwise.
func nodeNameOf(sel *v1.NodeSelector) string {
	if sel == nil || len(sel.NodeSelectorTerms) != 1 {
		return ""
	}
	for _, f := range sel.NodeSelectorTerms[0].MatchFields {
		if f.Key == "metadata.name" && f.Operator == v1.NodeSelectorOpIn && len(f.Values) == 1 {
			return f.Values[0]
		}
	}
	return ""
}

// cluster is what a fit works on: the claims, slices and classes as the API
// server has them now, the slices tainted by every DeviceTaintRule that
// skipRule does not accept (placement skips the controller's live
// reservations, see modelledRule), and the nodes and pods of the informers' caches by
// name.
func (r *reconciler) cluster(ctx context.Context, skipRule func(*resourceapi.DeviceTaintRule) bool) (*simulate.Snapshot, map[string]*v1.Node, []*v1.Pod, error) {
	snap, err := simulate.List(ctx, r.client, skipRule)
	if err != nil {
		return nil, nil, nil, err
	}
	nodeList, err := r.nodes.List(labels.Everything())
	if err != nil {
		return nil, nil, nil, err
	}
	nodes := map[string]*v1.Node{}
	for _, n := range nodeList {
		nodes[n.Name] = n
	}
	pods, err := r.pods.List(labels.Everything())
	if err != nil {
		return nil, nil, nil, err
	}
	return snap, nodes, pods, nil
}

// holds fills v.held: the domains gangs of higher priority (or of equal
// priority, reserved earlier) hold, which this gang keeps out of.
func (r *reconciler) holds(g *gangv1.Gang, v *view) {
	if r.allGangs != nil {
		priority, _ := gangPriority(v)
		v.held = heldDomains(r.allGangs(), g, priority)
	}
}

// writeClaims writes the claims of ws for placement id of gang g (the
// domain claim first, then the members' in parallel) and returns them as
// written (nil where a write failed); an
// Interrupt at StepClaimWritten makes it return errInterrupted.
func (r *reconciler) writeClaims(ctx context.Context, g *gangv1.Gang, id string, ws []claimWrite) ([]*resourceapi.ResourceClaim, error) {
	written := make([]*resourceapi.ResourceClaim, len(ws))
	var interrupted atomic.Bool
	write := func(i int) error {
		c, err := writeClaim(ctx, r.client, g, id, ws[i])
		written[i] = c
		if err == nil && r.interrupt != nil && r.interrupt(StepClaimWritten) {
			interrupted.Store(true)
		}
		return err
	}
	// The domain claim's channel first, alone: a placement that cannot
	// have its channel annotates no member.
	first := 0
	if len(ws) > 0 && ws[0].allocate {
		if err := write(0); err != nil || interrupted.Load() {
			if interrupted.Load() {
				return written, errInterrupted
			}
			return written, err
		}
		first = 1
	}
	err := parallel(len(ws)-first, func(i int) error { return write(first + i) })
	if interrupted.Load() {
		return written, errInterrupted
	}
	return written, err
}

// releaseAll releases the members of committed plan p (placement id) onto
// their nodes, in parallel, once yield has cleared their way (yieldToGang);
// the StepRelease test hook may cut it first.
func (r *reconciler) releaseAll(ctx context.Context, p *plan, id string, yield func() error) error {
	if r.interrupt != nil && r.interrupt(StepRelease) {
		return errInterrupted
	}
	if err := yield(); err != nil {
		return err
	}
	return parallel(len(p.members), func(i int) error {
		return release(ctx, r.client, p.members[i], p.nodes[i], id)
	})
}
