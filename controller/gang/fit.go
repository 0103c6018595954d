package gang

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sort"
	"strings"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/component-helpers/scheduling/corev1/nodeaffinity"
	"k8s.io/klog/v2"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/driver/domain"
	"github.com/tessera-dev/tessera/driver/simulate"
)

// candidate is a published domain pool.
type candidate struct {
	pool  string
	nodes []string
}

// plan is a placement of the whole gang in one domain, found by the
// scheduler's allocator against a snapshot.
type plan struct {
	pool string
	// domainAlloc is the shared domain claim's allocation; nil without a
	// domain claim.
	domainAlloc *resourceapi.AllocationResult
	// members are the members placed, in rank order: all of the view's
	// live members, or in an elastic gang those that fit. nodes[i] and
	// allocs[i] are members[i]'s node and its claims' allocations (in the
	// order of member.claims).
	members []*member
	nodes   []string
	allocs  [][]resourceapi.AllocationResult
}

// device is where a plan's domain claim went ("<pool>/<device>"), or the pool.
func (p *plan) device() string {
	if p.domainAlloc == nil || len(p.domainAlloc.Devices.Results) == 0 {
		return p.pool
	}
	r := p.domainAlloc.Devices.Results[0]
	return r.Pool + "/" + r.Device
}

// verdict is how close one domain came.
type verdict struct {
	pool   string
	placed int
	lacks  string
}

// candidates lists the published domain pools of driver (newest generation
// of each) with the nodes their selector matches, smallest first (fewest
// nodes), then by name: the smallest domain that fits is chosen, which keeps
// large domains whole.
func candidates(snap *simulate.Snapshot, driver string, nodes map[string]*v1.Node) []candidate {
	type seen struct {
		gen int64
		sel *v1.NodeSelector
	}
	pools := map[string]seen{}
	for _, s := range snap.Slices {
		if s.Spec.Driver != driver || s.Spec.NodeName != nil || s.Spec.NodeSelector == nil {
			continue
		}
		if _, _, ok := domain.ParsePool(s.Spec.Pool.Name); !ok {
			continue
		}
		if p, ok := pools[s.Spec.Pool.Name]; ok && p.gen > s.Spec.Pool.Generation {
			continue
		}
		pools[s.Spec.Pool.Name] = seen{gen: s.Spec.Pool.Generation, sel: s.Spec.NodeSelector}
	}
	out := make([]candidate, 0, len(pools))
	for name, p := range pools {
		sel, err := nodeaffinity.NewNodeSelector(p.sel)
		if err != nil {
			continue
		}
		c := candidate{pool: name}
		for _, n := range nodes {
			if sel.Match(n) {
				c.nodes = append(c.nodes, n.Name)
			}
		}
		if len(c.nodes) > 0 {
			sort.Strings(c.nodes)
			out = append(out, c)
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if len(out[i].nodes) != len(out[j].nodes) {
			return len(out[i].nodes) < len(out[j].nodes)
		}
		return out[i].pool < out[j].pool
	})
	return out
}

// clusterCandidate is every node with the driver's devices: where a Spread
// gang without a domain claim may go when no single domain fits it, since
// spreading over failure domains (racks) is its point.
func clusterCandidate(snap *simulate.Snapshot, driver string, nodes map[string]*v1.Node) candidate {
	set := map[string]bool{}
	for _, s := range snap.Slices {
		if s.Spec.Driver == driver && s.Spec.NodeName != nil && nodes[*s.Spec.NodeName] != nil {
			set[*s.Spec.NodeName] = true
		}
	}
	c := candidate{pool: clusterPool}
	for n := range set {
		c.nodes = append(c.nodes, n)
	}
	sort.Strings(c.nodes)
	return c
}

// clusterPool stands for the cluster candidate where a pool is named.
const clusterPool = "(no single domain)"

// search finds the smallest domain the whole gang fits in, laid out by its
// placement policy, with the scheduler's allocator over the snapshot (every
// allocated claim but the gang's own counts as taken). A Spread gang is
// first fitted with the spread as a limit; if that fits nowhere and the
// policy is only Preferred, it is fitted again with the spread as an order
// (as evenly as the nodes allow). It returns nil and every domain's verdict,
// closest first, when none fits.
func search(ctx context.Context, snap *simulate.Snapshot, driver string, nodes map[string]*v1.Node, room capacity, v *view) (*plan, []verdict, error) {
	cands := withoutIMEXBusy(candidates(snap, driver, nodes), v.imexBusy)
	if pl := gangv1.PlacementOf(&gangv1.GangSpec{Placement: v.placement}); pl.Policy == gangv1.PolicySpread && v.domainClaim == nil {
		if c := clusterCandidate(snap, driver, nodes); len(c.nodes) > 0 {
			cands = append(cands, c)
		}
	}
	var held []verdict
	cands = slices.DeleteFunc(cands, func(c candidate) bool {
		if why, ok := v.held[c.pool]; ok {
			held = append(held, verdict{pool: c.pool, lacks: why})
			return true
		}
		return false
	})
	p, verdicts, err := searchIn(ctx, snap, driver, nodes, room, v, cands)
	return p, append(verdicts, held...), err
}

// searchIn fits the gang into the first of cands that takes it, laid out by
// its placement policy (see search).
func searchIn(ctx context.Context, snap *simulate.Snapshot, driver string, nodes map[string]*v1.Node, room capacity, v *view, cands []candidate) (*plan, []verdict, error) {
	pl := gangv1.PlacementOf(&gangv1.GangSpec{Placement: v.placement})
	lay := newLayout(pl, true)
	p, verdicts, err := searchWith(ctx, snap, driver, nodes, room, v, cands, lay)
	if p != nil || err != nil || lay == nil || pl.Strength != gangv1.StrengthPreferred {
		return p, verdicts, err
	}
	klog.FromContext(ctx).V(3).Info("No domain meets the preferred spread; placing the gang as evenly as the nodes allow", "topologyKey", pl.TopologyKey, "maxPerValue", pl.MaxPerValue)
	return searchWith(ctx, snap, driver, nodes, room, v, cands, newLayout(pl, false))
}

// searchWith tries the candidates in order with one layout.
func searchWith(ctx context.Context, snap *simulate.Snapshot, driver string, nodes map[string]*v1.Node, room capacity, v *view, cands []candidate, lay *layout) (*plan, []verdict, error) {
	own := map[types.UID]bool{}
	if v.domainClaim != nil {
		own[v.domainClaim.UID] = true
	}
	for _, m := range v.live {
		for _, c := range m.claims {
			own[c.UID] = true
		}
	}
	nodeSlices := map[string][]*resourceapi.ResourceSlice{}
	poolSlices := map[string][]*resourceapi.ResourceSlice{}
	for _, s := range snap.Slices {
		switch {
		case s.Spec.NodeName != nil:
			nodeSlices[*s.Spec.NodeName] = append(nodeSlices[*s.Spec.NodeName], s)
		default:
			poolSlices[s.Spec.Pool.Name] = append(poolSlices[s.Spec.Pool.Name], s)
		}
	}
	var verdicts []verdict
	var best *plan
	bestExcess := 0
	for _, cand := range cands {
		sub := &simulate.Snapshot{Classes: snap.Classes, Claims: snap.Claims, Rules: snap.Rules, Slices: poolSlices[cand.pool]}
		for _, n := range cand.nodes {
			sub.Slices = append(sub.Slices, nodeSlices[n]...)
		}
		cluster := sub.Cluster(nil, func(c *resourceapi.ResourceClaim) bool { return own[c.UID] })
		takePins(ctx, cluster, v.pins, nodes, cand.nodes)
		l := lay.fresh()
		p, vd, err := fitDomain(ctx, cluster, sub, cand, nodes, room.of(cand.nodes), v, l)
		if err != nil {
			return nil, nil, err
		}
		if p == nil {
			verdicts = append(verdicts, vd)
			continue
		}
		// A hard layout (or none) takes the first domain that fits. A soft
		// one (a preferred spread no domain meets) takes the domain that
		// misses it least, the smallest of those.
		if l == nil || l.hard {
			klog.FromContext(ctx).V(3).Info("Domain fits the gang", "pool", cand.pool, "nodes", len(cand.nodes))
			return p, nil, nil
		}
		if e := l.excess(); best == nil || e < bestExcess {
			best, bestExcess = p, e
		}
	}
	if best != nil {
		klog.FromContext(ctx).V(3).Info("Domain fits the gang, missing its preferred spread least", "pool", best.pool, "excess", bestExcess)
		return best, nil, nil
	}
	sort.SliceStable(verdicts, func(i, j int) bool { return verdicts[i].placed > verdicts[j].placed })
	return nil, verdicts, nil
}

// fitDomain places the domain claim and then each member, in rank order, on
// the first node of the domain (in name order, resuming where the previous
// member went) that has room for the pod and whose devices the allocator
// accepts; it packs members onto as few nodes as it can. An elastic gang
// skips a member no node takes and fits when its minimums
// are met. With a spread
// layout, the nodes of the least used topology values come first (and,
// Required, values at the limit are left out). A node found full for one
// shape of claims is not tried again for that shape, so the search is
// linear in members plus nodes (times log nodes, spreading). sub holds the
// domain's slices, as the cluster was made from them, and the rules that
// tainted them: what a claim that fits nowhere is told.
func fitDomain(ctx context.Context, cluster *simulate.Cluster, sub *simulate.Snapshot, cand candidate, nodes map[string]*v1.Node, room capacity, v *view, lay *layout) (*plan, verdict, error) {
	vd := verdict{pool: cand.pool}
	var usable []*v1.Node
	for _, name := range cand.nodes {
		if n, ok := nodes[name]; ok && n.DeletionTimestamp == nil && !n.Spec.Unschedulable {
			usable = append(usable, n)
		}
	}
	if len(usable) == 0 {
		vd.lacks = "none of its nodes is schedulable (or, for IMEX, has an InternalIP and no other gang's IMEX daemon)"
		return nil, vd, nil
	}
	p := &plan{pool: cand.pool}
	if v.domainClaim != nil {
		res, err := allocate(ctx, cluster, usable[0], domain.Tolerating(v.domainClaim))
		if err != nil {
			return nil, vd, fmt.Errorf("domain %s: allocate domain claim %s/%s: %w", cand.pool, v.domainClaim.Namespace, v.domainClaim.Name, err)
		}
		if res == nil {
			vd.lacks = fmt.Sprintf("no free channel matches domain claim %s (all taken by other gangs, or its selectors rule this domain out)%s",
				v.domainClaim.Name, untolerated(sub.Rules, domainSlices(sub.Slices), domain.Tolerating(v.domainClaim)))
			return nil, vd, nil
		}
		cluster.Commit(res...)
		p.domainAlloc = &res[0]
	}
	for _, n := range v.grow {
		lay.take(n) // the members already placed count against the spread
	}
	full := map[string]map[string]bool{} // claim shape -> nodes without room
	cursor := 0
	skipped := ""
	for _, m := range v.live {
		shape := shapeOf(m.claims)
		if full[shape] == nil {
			full[shape] = map[string]bool{}
		}
		if len(m.claims) == 0 {
			p.members = append(p.members, m)
			p.nodes = append(p.nodes, "") // confined by the domain claim alone
			p.allocs = append(p.allocs, nil)
			continue
		}
		placed := false
		short := ""
		req := requests(m.pod)
		for _, i := range lay.order(usable, cursor) {
			n := usable[i]
			if full[shape][n.Name] || !podFits(m.pod, n) {
				continue
			}
			if lacks := room.fits(n.Name, req); lacks != "" {
				if short == "" {
					short = fmt.Sprintf("; node %s lacks %s for it", n.Name, lacks)
				}
				continue
			}
			res, err := allocate(ctx, cluster, n, m.claims...)
			if err != nil {
				return nil, vd, fmt.Errorf("domain %s: member %s on node %s: %w", cand.pool, m.ref(), n.Name, err)
			}
			if res == nil {
				full[shape][n.Name] = true
				continue
			}
			cluster.Commit(res...)
			room.take(n.Name, req)
			lay.take(n)
			p.members = append(p.members, m)
			p.nodes = append(p.nodes, n.Name)
			p.allocs = append(p.allocs, res)
			cursor = i
			placed = true
			break
		}
		if !placed {
			why := fmt.Sprintf("no node left for member %s (%s), whose claims need %s%s%s%s", m.ref(), m.describeRank(), describeClaims(m.claims), short, lay.lacks(usable),
				untolerated(sub.Rules, nodeSlicesOf(sub.Slices, usable), m.claims...))
			if !v.elastic {
				vd.placed = len(p.nodes)
				vd.lacks = fmt.Sprintf("room for %d of %d members; %s", len(p.nodes), len(v.live), why)
				return nil, vd, nil
			}
			if skipped == "" {
				skipped = why
			}
		}
	}
	if v.elastic {
		if short := v.short(p.members); short != "" {
			vd.placed = len(p.members)
			vd.lacks = fmt.Sprintf("room for %d members, %s; %s", len(p.members), short, skipped)
			return nil, vd, nil
		}
	}
	return p, vd, nil
}

// podFits checks what the allocator does not: the pod's node selector and
// required affinity, and taints it does not tolerate.
func podFits(pod *v1.Pod, n *v1.Node) bool {
	if ok, err := nodeaffinity.GetRequiredNodeAffinity(pod).Match(n); err != nil || !ok {
		return false
	}
	for i := range n.Spec.Taints {
		t := &n.Spec.Taints[i]
		if t.Effect != v1.TaintEffectNoSchedule && t.Effect != v1.TaintEffectNoExecute {
			continue
		}
		tolerated := false
		for j := range pod.Spec.Tolerations {
			if pod.Spec.Tolerations[j].ToleratesTaint(klog.Background(), t, false) {
				tolerated = true
				break
			}
		}
		if !tolerated {
			return false
		}
	}
	return true
}

// untolerated names, as a clause of a no-fit message, the taints on the
// devices of slices that a request of claims does not tolerate (an
// administrator's DeviceTaintRule, a health taint): the allocator skips
// those devices for it, as the scheduler's does. "" when there are none.
func untolerated(rules []*resourceapi.DeviceTaintRule, slices []*resourceapi.ResourceSlice, claims ...*resourceapi.ResourceClaim) string {
	seen := map[string]bool{}
	var taints []string
	add := func(tols []resourceapi.DeviceToleration) {
		for _, t := range simulate.Untolerated(slices, rules, tols) {
			if !seen[t] {
				seen[t] = true
				taints = append(taints, t)
			}
		}
	}
	for _, c := range claims {
		for _, r := range c.Spec.Devices.Requests {
			if r.Exactly != nil {
				add(r.Exactly.Tolerations)
			}
			for _, sub := range r.FirstAvailable {
				add(sub.Tolerations)
			}
		}
	}
	if len(taints) == 0 {
		return ""
	}
	sort.Strings(taints)
	if len(taints) > 3 {
		taints = append(taints[:3], fmt.Sprintf("%d more", len(taints)-3))
	}
	return "; devices there carry taints its claims do not tolerate: " + strings.Join(taints, ", ")
}

// domainSlices are the slices of multi-node pools (the domain's channels).
func domainSlices(slices []*resourceapi.ResourceSlice) []*resourceapi.ResourceSlice {
	var out []*resourceapi.ResourceSlice
	for _, s := range slices {
		if s.Spec.NodeName == nil {
			out = append(out, s)
		}
	}
	return out
}

// nodeSlicesOf are the slices of these nodes' own pools.
func nodeSlicesOf(slices []*resourceapi.ResourceSlice, nodes []*v1.Node) []*resourceapi.ResourceSlice {
	on := map[string]bool{}
	for _, n := range nodes {
		on[n.Name] = true
	}
	var out []*resourceapi.ResourceSlice
	for _, s := range slices {
		if s.Spec.NodeName != nil && on[*s.Spec.NodeName] {
			out = append(out, s)
		}
	}
	return out
}

// shapeOf keys claims by what they ask for: members with equal shapes fit
// the same nodes.
func shapeOf(claims []*resourceapi.ResourceClaim) string {
	var b strings.Builder
	for _, c := range claims {
		raw, _ := json.Marshal(c.Spec)
		b.Write(raw)
		b.WriteByte(0)
	}
	return b.String()
}

// describeClaims says in words what claims ask for.
func describeClaims(claims []*resourceapi.ResourceClaim) string {
	var parts []string
	for _, c := range claims {
		for _, r := range c.Spec.Devices.Requests {
			if r.Exactly != nil {
				count := fmt.Sprint(r.Exactly.Count)
				if r.Exactly.AllocationMode == resourceapi.DeviceAllocationModeAll {
					count = "all"
				}
				parts = append(parts, fmt.Sprintf("%s %s", count, r.Exactly.DeviceClassName))
			} else {
				parts = append(parts, fmt.Sprintf("request %s (with alternatives)", r.Name))
			}
		}
	}
	if len(parts) == 0 {
		return "no devices"
	}
	return strings.Join(parts, " + ")
}
