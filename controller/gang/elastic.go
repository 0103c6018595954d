package gang

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/google/uuid"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/driver/simulate"
)

// This file grows an elastic gang (spec.minSize/maxSize, or roles with
// minSize) inside the domain of its committed placement: members that did
// not fit when it was placed, and replacements of members it lost, join the
// same placement when room appears there.
//
// A growth is written like a placement, with the same crash story: the
// gang records the new members' claims (UncommittedPlacement with Growth)
// before writing any; the claims are written with the committed placement's
// ID, checked against every other allocated claim, and the record is
// dropped, which commits them; only then are the new members released. A
// crash before the record is dropped leaves it, and the next look clears
// exactly those claims (the placement and its running members are left
// alone) and grows again.

// survivorsOf are the members that count towards an elastic gang's
// minimums: the live members of placement id (in) and those of its pods
// that succeeded (their role from the annotation they were released with).
func survivorsOf(in []*member, all []*v1.Pod, roles []string, id string) []*member {
	out := slices.Clone(in)
	for _, p := range all {
		if p.Annotations[gangv1.AnnotationPlacement] != id || p.Status.Phase != v1.PodSucceeded || p.DeletionTimestamp != nil {
			continue
		}
		m := &member{pod: p, role: p.Annotations[gangv1.AnnotationRole]}
		m.roleIndex = slices.Index(roles, m.role)
		if m.role != "" && m.roleIndex < 0 {
			continue
		}
		out = append(out, m)
	}
	return out
}

// joining are an elastic gang's gated members that its placement does not
// hold, in rank order, at most as many as each role (and the gang) has
// room for beside the survivors.
func joining(g *gangv1.Gang, v *view, survivors []*member) []*member {
	_, most := gangv1.Bounds(&g.Spec)
	room := int(most) - len(survivors)
	roleRoom := make([]int, len(g.Spec.Roles))
	for i, r := range g.Spec.Roles {
		roleRoom[i] = int(r.Size)
	}
	held := map[*v1.Pod]bool{}
	for _, m := range survivors {
		held[m.pod] = true
		if m.role != "" {
			roleRoom[m.roleIndex]--
		}
	}
	var out []*member
	for _, m := range v.live {
		if room <= 0 {
			break
		}
		if !m.gated() || held[m.pod] || (m.role != "" && roleRoom[m.roleIndex] <= 0) {
			continue
		}
		out = append(out, m)
		room--
		if m.role != "" {
			roleRoom[m.roleIndex]--
		}
	}
	return out
}

// grow adds the gang's joining members to its committed placement id, in
// that placement's domain, as many as fit there now.
func (r *reconciler) grow(ctx context.Context, g *gangv1.Gang, v *view, id string, in []*member, st *gangv1.GangStatus) (result, error) {
	logger := klog.FromContext(ctx)
	survivors := survivorsOf(in, v.all, v.roleNames, id)
	join := joining(g, v, survivors)
	if len(join) == 0 {
		return result{}, nil
	}
	if v.pending != "" {
		return result{requeueAfter: 2 * time.Second}, nil // a new member's claims are still being made
	}
	snap, nodes, pods, err := r.cluster(ctx, r.modelledRule)
	if err != nil {
		return result{}, err
	}
	r.holds(g, v)
	cand, ok := r.placementDomain(snap, v, in, nodes)
	if !ok {
		logger.V(2).Info("Cannot tell the domain of the gang's placement; not growing it", "placement", id)
		return result{}, nil
	}
	if why, held := v.held[cand.pool]; held {
		logger.V(3).Info("Not growing the gang: its domain is held", "domain", cand.pool, "why", why)
		return result{}, nil
	}
	// No minimum for a growth: as many as fit join (the roles' lists
	// sized for the count, all zero).
	gv := &view{live: join, elastic: true, placement: v.placement, roleLeast: make([]int, len(v.roleLeast)), roleNames: v.roleNames}
	for _, m := range in {
		if n := nodes[m.pod.Spec.NodeName]; n != nil {
			gv.grow = append(gv.grow, n)
		}
	}
	gv.pins = pendingPins(pods, snap.Claims, gv.has)
	p, _, err := searchIn(ctx, snap, r.driver, nodes, newCapacity(nodes, pods), gv, []candidate{cand})
	if err != nil || p == nil || len(p.members) == 0 {
		return result{}, err
	}
	ws := writes(g, gv, p, nodes)
	if stale, err := conflicts(ctx, r.client, snap, nodes, planned(ws)); err != nil || stale != "" {
		return result{requeueAfter: time.Second}, err
	}
	attempt := uuid.NewString()[:8]
	for i := range ws {
		ws[i].annotations[gangv1.AnnotationGrowth] = attempt
	}
	recorded, err := r.recordPlacement(ctx, g, id, attempt, ws)
	if err != nil {
		return result{}, err
	}
	written, err := r.writeClaims(ctx, recorded, id, ws)
	if errors.Is(err, errInterrupted) {
		return result{}, err
	}
	conflict := ""
	if err == nil {
		conflict, err = conflicts(ctx, r.client, snap, nodes, written)
	}
	if err == nil && conflict == "" {
		committed := recorded.DeepCopy()
		delete(committed.Annotations, gangv1.AnnotationUncommitted)
		_, err = r.gangs.Update(ctx, committed)
	}
	if err != nil || conflict != "" {
		_, _, rbErr := r.rollBackRecorded(ctx, recorded)
		if err != nil {
			return result{requeueAfter: time.Second}, fmt.Errorf("grow gang %s/%s: %w", g.Namespace, g.Name, errors.Join(err, rbErr))
		}
		logger.V(2).Info("Growth rolled back", "why", conflict)
		return result{requeueAfter: time.Second}, rbErr
	}
	priority, _ := gangPriority(v)
	yield := func() error {
		return r.yieldToGang(ctx, g, priority, p.nodes, func(nodes []string) (map[string]string, error) {
			return poolsOf(snap, r.driver, nodes), nil
		})
	}
	if err := r.releaseAll(ctx, p, id, yield); err != nil {
		return result{}, err // committed: the next look releases the rest
	}
	_, most := gangv1.Bounds(&g.Spec)
	now := len(survivors) + len(p.members)
	var placedNodes []string
	for _, m := range in {
		placedNodes = append(placedNodes, m.pod.Spec.NodeName)
	}
	placedNodes = append(placedNodes, p.nodes...)
	shrank := shrunkCondition(st)
	placed(st, g.Generation, st.Domain, placedNodes, len(in)+len(p.members), r.spreadNotMet(g, placedNodes))
	st.PlacedMembers = int32(now)
	keepShrunk(g, st, shrank, now)
	r.recorder.Eventf(g, v1.EventTypeNormal, gangv1.ReasonGrown, "added %d members to the placement in %s; it has %d of at most %d", len(p.members), cand.pool, now, most)
	logger.Info("Elastic gang grew", "domain", cand.pool, "added", len(p.members), "members", now, "most", most, "placement", id)
	return result{}, nil
}

// placementDomain is the domain of the gang's placement, with the nodes it
// may grow on: the domain claim's pool (with IMEX daemons, only the nodes
// the claim's daemons were configured with), or without a domain claim the
// smallest published domain holding every placed member's node.
func (r *reconciler) placementDomain(snap *simulate.Snapshot, v *view, in []*member, nodes map[string]*v1.Node) (candidate, bool) {
	cands := candidates(snap, r.driver, nodes)
	if dc := v.domainClaim; dc != nil {
		if dc.Status.Allocation == nil || len(dc.Status.Allocation.Devices.Results) == 0 {
			return candidate{}, false
		}
		pool := dc.Status.Allocation.Devices.Results[0].Pool
		for _, c := range cands {
			if c.pool != pool {
				continue
			}
			if r.imex {
				served, err := gangv1.ParseNodes(dc.Annotations[gangv1.AnnotationNodes])
				if err != nil {
					return candidate{}, false
				}
				c.nodes = slices.DeleteFunc(slices.Clone(c.nodes), func(n string) bool {
					return !slices.ContainsFunc(served, func(s gangv1.Node) bool { return s.Name == n })
				})
			}
			return c, true
		}
		return candidate{}, false
	}
	var on []string
	for _, m := range in {
		if n := nodeOf(m, v); n != "" {
			on = append(on, n)
		}
	}
	if len(on) == 0 {
		return candidate{}, false
	}
	for _, c := range cands {
		if !slices.ContainsFunc(on, func(n string) bool { _, found := slices.BinarySearch(c.nodes, n); return !found }) {
			return c, true
		}
	}
	if pl := gangv1.PlacementOf(&gangv1.GangSpec{Placement: v.placement}); pl.Policy == gangv1.PolicySpread {
		// Placed over several domains: it may grow on every node but
		// those of domains held for other gangs.
		c := clusterCandidate(snap, r.driver, nodes)
		heldNodes := map[string]bool{}
		for _, d := range cands {
			if _, ok := v.held[d.pool]; ok {
				for _, n := range d.nodes {
					heldNodes[n] = true
				}
			}
		}
		c.nodes = slices.DeleteFunc(c.nodes, func(n string) bool { return heldNodes[n] })
		return c, true
	}
	return candidate{}, false
}

// gangIndex is every gang by "<namespace>/<name>" (nil without the
// informer).
func (r *reconciler) gangIndex() map[string]*gangv1.Gang {
	if r.allGangs == nil {
		return nil
	}
	out := map[string]*gangv1.Gang{}
	for _, g := range r.allGangs() {
		out[g.Namespace+"/"+g.Name] = g
	}
	return out
}

// shrunkCondition is a copy of the gang's Failed condition when it says
// the gang shrank; nil otherwise.
func shrunkCondition(st *gangv1.GangStatus) *metav1.Condition {
	if c := meta.FindStatusCondition(st.Conditions, gangv1.ConditionFailed); c != nil && c.Reason == gangv1.ReasonShrunk {
		return c.DeepCopy()
	}
	return nil
}

// keepShrunk puts back the Failed=False/Shrunk condition that placed()
// replaced while the gang still holds fewer than its most members: it says
// what the gang lost until it has grown back.
func keepShrunk(g *gangv1.Gang, st *gangv1.GangStatus, shrank *metav1.Condition, members int) {
	if _, most := gangv1.Bounds(&g.Spec); shrank != nil && members < int(most) {
		meta.SetStatusCondition(&st.Conditions, *shrank)
	}
}
