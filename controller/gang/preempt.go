package gang

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/driver/simulate"
)

// Gang preemption. A gang that fits no domain may free one by evicting pods
// of lower priority there, as a unit: a placed gang's pods all together,
// another pod alone. The state lives in the API, as the placement's does:
// the evicted pods are being deleted (their claims count as free in the
// preemption's own fit check, so a later look evicts nothing more while
// they end), and the gang's status.preemption names the domain, which keeps
// gangs of lower priority out of it meanwhile.

// unit is what a preemption evicts together.
type unit struct {
	// name says what it is: "gang ml/train" or "pod ml/x".
	name string
	pods []*v1.Pod
	// priority is the highest of its pods': a unit is as protected as its
	// most important pod.
	priority int32
	// order ranks the members an elastic gang may lose alone: its next
	// to go first (0); 0 for every other unit.
	order int
}

// podPriority is the pod's priority (from its PriorityClass); 0 without.
func podPriority(p *v1.Pod) int32 {
	if p.Spec.Priority != nil {
		return *p.Spec.Priority
	}
	return 0
}

// gangPriority is the lowest of the live members' priorities, so that a
// gang never preempts a pod as important as any of its members; mayPreempt
// is false when a member's preemptionPolicy is Never.
func gangPriority(v *view) (priority int32, mayPreempt bool) {
	mayPreempt = len(v.live) > 0
	for i, m := range v.live {
		if p := podPriority(m.pod); i == 0 || p < priority {
			priority = p
		}
		if pp := m.pod.Spec.PreemptionPolicy; pp != nil && *pp == v1.PreemptNever {
			mayPreempt = false
		}
	}
	return priority, mayPreempt
}

// heldDomains are the domains that other gangs of higher priority than
// priority preempted pods in and still wait for (their status.preemption),
// and those other gangs of at least that priority reserved
// (status.reservation), with why, for the waiting gang's message.
func heldDomains(gangs []*gangv1.Gang, self *gangv1.Gang, priority int32) map[string]string {
	held := map[string]string{}
	for _, o := range gangs {
		if (o.Namespace == self.Namespace && o.Name == self.Name) || o.Annotations[gangv1.AnnotationCommitted] != "" || o.DeletionTimestamp != nil {
			continue
		}
		if pre := o.Status.Preemption; pre != nil && pre.Priority > priority {
			held[pre.Domain] = fmt.Sprintf("held for gang %s/%s (priority %d), which preempted pods there", o.Namespace, o.Name, pre.Priority)
		}
		if res := o.Status.Reservation; res != nil && reservationHolds(o, self, priority) {
			if _, ok := held[res.Domain]; !ok {
				held[res.Domain] = fmt.Sprintf("reserved for gang %s/%s (priority %d) from %s", o.Namespace, o.Name, res.Priority, res.Start.UTC().Format(time.RFC3339))
			}
		}
	}
	return held
}

// reservationHolds says whether gang o's reservation holds its devices
// against a gang (self) or, with self nil, a pod of priority: against lower
// priorities, and against a gang of its own priority that came after it
// (then by UID: one of two gangs that reserved the same domain from stale
// caches gives way). Against anything else it yields: such a gang may be
// placed in its domain (heldDomains), and the rules go from the nodes it is
// placed on (yieldToGang); such a pod is given a node (yieldToPods).
func reservationHolds(o, self *gangv1.Gang, priority int32) bool {
	res := o.Status.Reservation
	if res == nil {
		return false
	}
	if res.Priority != priority {
		return res.Priority > priority
	}
	return self == nil || before(o, self)
}

// before orders gangs of one priority: the older first, then by UID.
func before(a, b *gangv1.Gang) bool {
	if !a.CreationTimestamp.Equal(&b.CreationTimestamp) {
		return a.CreationTimestamp.Before(&b.CreationTimestamp)
	}
	return a.UID < b.UID
}

// preemption is what one look found: evict victims (none when the pods
// evicted earlier only have to end) to place the gang in domain.
type preemption struct {
	domain  string
	victims []unit
	// ending are pods on the domain's nodes already on their way out whose
	// claims the fit check counted as free.
	ending []string
}

// preemptor judges preemptions against one snapshot of the cluster.
type preemptor struct {
	snap   *simulate.Snapshot
	driver string
	nodes  map[string]*v1.Node
	pods   []*v1.Pod
	imex   bool
	v      *view
	now    time.Time
	// byUID are the pods that exist, by UID.
	byUID map[types.UID]*v1.Pod
	// podClaims are each pod's allocated claims of the driver.
	podClaims map[types.UID][]*resourceapi.ResourceClaim
	// gangs are the gangs by "<namespace>/<name>": an elastic one's
	// members above its minimums are units of their own. Nil: none is.
	gangs map[string]*gangv1.Gang
	// staying are the pods ("<namespace>/<name>") a reservation counts
	// as staying (stayingPods): never backfill. Nil: none is.
	staying map[string]bool
}

func newPreemptor(snap *simulate.Snapshot, driver string, nodes map[string]*v1.Node, pods []*v1.Pod, imex bool, v *view, now time.Time) *preemptor {
	pr := &preemptor{snap: snap, driver: driver, nodes: nodes, pods: pods, imex: imex, v: v, now: now, byUID: map[types.UID]*v1.Pod{}, podClaims: map[types.UID][]*resourceapi.ResourceClaim{}}
	byUID := map[types.UID][]*resourceapi.ResourceClaim{}
	for _, c := range snap.Claims {
		if c.Status.Allocation == nil || !ofDriver(c, driver) {
			continue
		}
		for _, ref := range c.Status.ReservedFor {
			if ref.Resource == "pods" && ref.APIGroup == "" {
				byUID[ref.UID] = append(byUID[ref.UID], c)
			}
		}
	}
	for _, p := range pods {
		pr.byUID[p.UID] = p
		pr.podClaims[p.UID] = byUID[p.UID]
	}
	return pr
}

// ofDriver says whether the claim holds a device of driver.
func ofDriver(c *resourceapi.ResourceClaim, driver string) bool {
	for _, r := range c.Status.Allocation.Devices.Results {
		if r.Driver == driver {
			return true
		}
	}
	return false
}

// freed says whether evicting the pods in gone frees claim c: it is
// reserved for pods only, and each is evicted, on its way out, or gone.
func (pr *preemptor) freed(c *resourceapi.ResourceClaim, gone map[types.UID]bool) bool {
	if c.Status.Allocation == nil || len(c.Status.ReservedFor) == 0 {
		return false
	}
	for _, ref := range c.Status.ReservedFor {
		if ref.Resource != "pods" || ref.APIGroup != "" {
			return false
		}
		if p, ok := pr.byUID[ref.UID]; ok && !gone[ref.UID] && !pr.leaving(p) {
			return false
		}
	}
	return true
}

// stuckAfter is how long past its deletion's deadline a pod is still
// expected to go (a kubelet that was slow): after it, a finalizer or a lost
// node holds it, and its claims are not counted as freed.
const stuckAfter = time.Minute

// leaving says whether a pod is on its way out: ended, or being deleted
// and not stuck past its deadline.
func (pr *preemptor) leaving(p *v1.Pod) bool {
	if p.DeletionTimestamp != nil {
		return pr.now.Before(p.DeletionTimestamp.Add(stuckAfter))
	}
	return finished(p)
}

// fits says whether the gang fits in cand once the units' pods are gone.
func (pr *preemptor) fits(ctx context.Context, cand candidate, units []unit) (bool, error) {
	p, err := pr.plan(ctx, cand, units)
	return p != nil, err
}

// plan places the gang in cand once the units' pods are gone; nil when it
// does not fit.
func (pr *preemptor) plan(ctx context.Context, cand candidate, units []unit) (*plan, error) {
	gone := map[types.UID]bool{}
	for _, u := range units {
		for _, p := range u.pods {
			gone[p.UID] = true
		}
	}
	snap := &simulate.Snapshot{Classes: pr.snap.Classes, Slices: pr.snap.Slices, Rules: pr.snap.Rules}
	for _, c := range pr.snap.Claims {
		if !pr.freed(c, gone) {
			snap.Claims = append(snap.Claims, c)
		}
	}
	var left []*v1.Pod
	for _, p := range pr.pods {
		if !gone[p.UID] {
			left = append(left, p)
		}
	}
	v := *pr.v
	cands := []candidate{{pool: cand.pool, nodes: slices.Clone(cand.nodes)}}
	if pr.imex && v.domainClaim != nil {
		cands = withoutIMEXBusy(cands, imexUnusable(snap.Claims, pr.driver, v.domainClaim.UID, pr.nodes))
	}
	p, _, err := searchIn(ctx, snap, pr.driver, pr.nodes, newCapacity(pr.nodes, left), &v, cands)
	return p, err
}

// units are the pods on cand's nodes holding the driver's devices that a
// gang of priority may evict, grouped: the live pods of one placed gang
// (its placement annotation) together, any other pod alone. A unit of
// priority or higher, one that a PodDisruptionBudget would not let go whole,
// and the gang's own members are left out. ending lists the pods on its
// nodes already on their way out.
func (pr *preemptor) units(cand candidate, priority int32, budgets []*policyv1.PodDisruptionBudget) (eligible []unit, ending []string) {
	on := map[string]bool{}
	for _, n := range cand.nodes {
		on[n] = true
	}
	own := map[types.UID]bool{}
	for _, m := range pr.v.live {
		own[m.pod.UID] = true
	}
	byKey := map[string]*unit{}
	var keys []string
	for _, p := range pr.pods {
		if !on[p.Spec.NodeName] || own[p.UID] || len(pr.podClaims[p.UID]) == 0 {
			continue
		}
		if pr.leaving(p) {
			ending = append(ending, p.Namespace+"/"+p.Name)
			continue
		}
		if finished(p) {
			continue // stuck on its way out: neither ending nor evictable
		}
		key, name := "pod "+p.Namespace+"/"+p.Name, "pod "+p.Namespace+"/"+p.Name
		if id := p.Annotations[gangv1.AnnotationPlacement]; id != "" {
			key, name = "placement "+p.Namespace+"/"+id, "gang "+pr.gangOf(p)
		}
		if byKey[key] == nil {
			byKey[key] = &unit{name: name}
			keys = append(keys, key)
		}
	}
	for _, p := range pr.pods {
		if finished(p) || own[p.UID] {
			continue
		}
		key := "pod " + p.Namespace + "/" + p.Name
		if id := p.Annotations[gangv1.AnnotationPlacement]; id != "" {
			key = "placement " + p.Namespace + "/" + id
		}
		u := byKey[key]
		if u == nil {
			continue
		}
		if len(u.pods) == 0 || podPriority(p) > u.priority {
			u.priority = podPriority(p)
		}
		u.pods = append(u.pods, p)
	}
	var all []unit
	for _, k := range keys {
		u := byKey[k]
		// A gang's members go in the order its own repairs evict them:
		// the last role's (highest ranks) first.
		sort.SliceStable(u.pods, func(i, j int) bool { return rankOf(u.pods[i]) > rankOf(u.pods[j]) })
		if g := pr.gangs[pr.gangOf(u.pods[0])]; strings.HasPrefix(k, "placement ") && g != nil && gangv1.Elastic(&g.Spec) {
			all = append(all, splitElastic(*u, g, on)...)
			continue
		}
		all = append(all, *u)
	}
	for _, u := range all {
		if u.priority >= priority || !budgetsAllow(budgets, u.pods) {
			continue
		}
		eligible = append(eligible, u)
	}
	sort.SliceStable(eligible, func(i, j int) bool {
		a, b := eligible[i], eligible[j]
		return cmp.Or(cmp.Compare(a.priority, b.priority), cmp.Compare(len(a.pods), len(b.pods)), cmp.Compare(a.order, b.order), cmp.Compare(a.name, b.name)) < 0
	})
	return eligible, ending
}

// gangOf names the gang of a placed pod from its claims' gang annotation,
// else by its placement.
func (pr *preemptor) gangOf(p *v1.Pod) string {
	for _, c := range pr.podClaims[p.UID] {
		if g := c.Annotations[gangv1.AnnotationGang]; g != "" {
			return g
		}
	}
	return p.Namespace + " placement " + p.Annotations[gangv1.AnnotationPlacement]
}

// rankOf is a released member's rank (-1 without one).
func rankOf(p *v1.Pod) int {
	r, err := strconv.Atoi(p.Annotations[gangv1.AnnotationRank])
	if err != nil {
		return -1
	}
	return r
}

// budgetsAllow says whether every PodDisruptionBudget covering the pods
// allows evicting all of them at once.
func budgetsAllow(budgets []*policyv1.PodDisruptionBudget, pods []*v1.Pod) bool {
	for _, b := range budgets {
		if b.Spec.Selector == nil {
			continue // policy/v1: a budget without a selector covers no pod
		}
		// An empty selector covers every pod of the namespace.
		sel, err := metav1.LabelSelectorAsSelector(b.Spec.Selector)
		if err != nil {
			continue
		}
		n := int32(0)
		for _, p := range pods {
			if p.Namespace == b.Namespace && sel.Matches(labels.Set(p.Labels)) {
				n++
			}
		}
		if n > 0 && n > b.Status.DisruptionsAllowed {
			return false
		}
	}
	return true
}

// cost orders preemptions: the lowest highest victim priority, then the
// fewest pods, then the lowest sum of priorities.
type cost struct {
	maxPriority int32
	pods        int
	sum         int64
}

func costOf(units []unit) cost {
	var c cost
	for i, u := range units {
		if i == 0 || u.priority > c.maxPriority {
			c.maxPriority = u.priority
		}
		c.pods += len(u.pods)
		for _, p := range u.pods {
			c.sum += int64(podPriority(p))
		}
	}
	return c
}

func (c cost) less(o cost) bool {
	return cmp.Or(cmp.Compare(c.maxPriority, o.maxPriority), cmp.Compare(c.pods, o.pods), cmp.Compare(c.sum, o.sum)) < 0
}

// maxReprieves bounds how many chosen units a preemption tries to spare.
const maxReprieves = 32

// choose finds the cheapest preemption over cands (smallest domain first
// among equals), or nil when no domain fits even with every eligible unit
// gone. A domain that fits once the pods already ending are gone wins with
// no victims: the gang waits for them. At the look's cap of allocator
// calls it stops with the cheapest among the domains tried (cut).
func (pr *preemptor) choose(ctx context.Context, cands []candidate, priority int32, budgets []*policyv1.PodDisruptionBudget) (*preemption, error) {
	var best *preemption
	var bestCost cost
	for _, cand := range cands {
		eligible, ending := pr.units(cand, priority, budgets)
		ok, err := pr.fits(ctx, cand, nil)
		if err != nil {
			return cut(ctx, best, err)
		}
		if ok {
			return &preemption{domain: cand.pool, ending: ending}, nil
		}
		if len(eligible) == 0 {
			continue
		}
		if ok, err = pr.fits(ctx, cand, eligible); err != nil || !ok {
			if err != nil {
				return cut(ctx, best, err)
			}
			continue
		}
		// The shortest prefix of the cheapest units that frees enough (a
		// binary search: more units gone never fits less), then every unit
		// of it not needed, the most important first, is spared.
		lo, hi := 1, len(eligible)
		for lo < hi {
			mid := (lo + hi) / 2
			if ok, err = pr.fits(ctx, cand, eligible[:mid]); err != nil {
				return cut(ctx, best, err)
			} else if ok {
				hi = mid
			} else {
				lo = mid + 1
			}
		}
		victims := slices.Clone(eligible[:lo])
		// At most maxReprieves tries (each a fit of the whole gang), the
		// most important units first: the cost of a look stays bounded
		// with thousands of small victims.
		for i, tries := len(victims)-1, 0; i >= 0 && len(victims) > 1 && tries < maxReprieves; i, tries = i-1, tries+1 {
			without := slices.Delete(slices.Clone(victims), i, i+1)
			if ok, err = pr.fits(ctx, cand, without); err != nil {
				return cut(ctx, best, err)
			} else if ok {
				victims = without
			}
		}
		// Units allowed one by one may overspend a budget together.
		var all []*v1.Pod
		for _, u := range victims {
			all = append(all, u.pods...)
		}
		if !budgetsAllow(budgets, all) {
			continue
		}
		if c := costOf(victims); best == nil || c.less(bestCost) {
			best, bestCost = &preemption{domain: cand.pool, victims: victims, ending: ending}, c
		}
	}
	return best, nil
}

// cut ends choose on err: past the cap of allocator calls of the look's
// preemption step (maxAllocatorCallsPerStep), the cheapest preemption among the domains
// tried whole stands (nil: none); any other error fails the look.
func cut(ctx context.Context, best *preemption, err error) (*preemption, error) {
	if !errors.Is(err, errAllocatorCalls) {
		return nil, err
	}
	klog.FromContext(ctx).Info("Stopped comparing domains for a preemption at the look's cap of allocator calls", "found", best != nil)
	return best, nil
}

// preempt looks for a domain the gang would fit in once pods of lower
// priority are evicted there, and evicts them. It returns false (and does
// nothing) when the gang may not preempt or no domain would fit; else it
// records the preemption in st (Waiting/Preempting, status.preemption).
func (r *reconciler) preempt(ctx context.Context, g *gangv1.Gang, v *view, snap *simulate.Snapshot, nodes map[string]*v1.Node, pods []*v1.Pod, st *gangv1.GangStatus) (bool, error) {
	priority, may := gangPriority(v)
	if !may {
		return false, nil
	}
	// Preemption spends a budget of its own: however many domains it
	// compares, the reservation after it gets its whole budget.
	ctx = allocatorStep(ctx, stepPreemption)
	var cands []candidate
	for _, c := range candidates(snap, r.driver, nodes) {
		if _, held := v.held[c.pool]; !held {
			cands = append(cands, c)
		}
	}
	pdbs, err := r.budgets.List(labels.Everything())
	if err != nil {
		return false, fmt.Errorf("list PodDisruptionBudgets for preemption: %w", err)
	}
	pr := newPreemptor(snap, r.driver, nodes, pods, r.imex, v, time.Now())
	pr.gangs = r.gangIndex()
	pre, err := pr.choose(ctx, cands, priority, pdbs)
	if err != nil || pre == nil {
		return false, err
	}
	logger := klog.FromContext(ctx)
	var names, described []string
	count := 0
	for _, u := range pre.victims {
		described = append(described, fmt.Sprintf("%s (priority %d, %d pods)", u.name, u.priority, len(u.pods)))
		for _, p := range u.pods {
			names = append(names, p.Namespace+"/"+p.Name)
			count++
		}
	}
	if len(pre.victims) > 0 {
		msg := fmt.Sprintf("preempting %d pods of lower priority in %s for this gang (priority %d): %s", count, pre.domain, priority, strings.Join(described, ", "))
		r.recorder.Event(g, v1.EventTypeNormal, gangv1.ReasonPreempting, msg)
		logger.Info("Gang preempts lower-priority pods", "domain", pre.domain, "priority", priority, "victims", described)
		for _, u := range pre.victims {
			for _, p := range u.pods {
				r.recorder.Eventf(p, v1.EventTypeNormal, gangv1.ReasonPreempted, "preempted by gang %s/%s (priority %d) in %s", g.Namespace, g.Name, priority, pre.domain)
				if err := evict(ctx, r.client, p); err != nil {
					// The rest are still evicted: a victim gang with a
					// member gone is repaired as a whole by its own
					// reconcile anyway.
					logger.Error(err, "Could not evict a pod the gang preempts", "pod", klog.KObj(p))
				}
			}
		}
		r.metrics.attempt("preempting")
	} else {
		names = pre.ending
	}
	sort.Strings(names)
	waitingFor := fmt.Sprintf("waiting for %d preempted pods to end in %s", len(names), pre.domain)
	if len(pre.victims) > 0 {
		waitingFor = fmt.Sprintf("evicted %d pods of lower priority in %s (%s); waiting for them to end", count, pre.domain, strings.Join(described, ", "))
	}
	waitingFor += cutNote(ctx)
	if len(names) > gangv1.MaxPreemptionVictims {
		names = names[:gangv1.MaxPreemptionVictims]
	}
	st.Preemption = &gangv1.Preemption{Domain: pre.domain, Priority: priority, Victims: names}
	waiting(st, g.Generation, gangv1.ReasonPreempting, waitingFor)
	return true, nil
}

// splitElastic divides the unit of an elastic gang's placement (its pods in
// rank order, highest first) into one unit per member it may lose alone and
// the rest: going through its members last role first, highest rank first,
// each member on the domain's nodes (on) is its own unit while the gang,
// and the member's role, keep more than their minimums without it. The
// rest (the minimums, and the members elsewhere) stays one unit: a leader
// is never taken from its workers, only the whole gang.
func splitElastic(u unit, g *gangv1.Gang, on map[string]bool) []unit {
	least, _ := gangv1.Bounds(&g.Spec)
	roleOf := func(p *v1.Pod) int {
		return slices.IndexFunc(g.Spec.Roles, func(r gangv1.Role) bool { return r.Name == p.Annotations[gangv1.AnnotationRole] })
	}
	pods := slices.Clone(u.pods)
	sort.SliceStable(pods, func(i, j int) bool { return roleOf(pods[i]) > roleOf(pods[j]) })
	perRole := make([]int, len(g.Spec.Roles))
	for _, p := range pods {
		if i := roleOf(p); i >= 0 {
			perRole[i]++
		}
	}
	var out []unit
	rest := unit{name: u.name}
	left := len(pods)
	for _, p := range pods {
		i := roleOf(p)
		alone := on[p.Spec.NodeName] && left > int(least) && (len(g.Spec.Roles) == 0 || (i >= 0 && perRole[i] > int(gangv1.RoleMin(g.Spec.Roles[i]))))
		if !alone {
			if len(rest.pods) == 0 || podPriority(p) > rest.priority {
				rest.priority = podPriority(p)
			}
			rest.pods = append(rest.pods, p)
			continue
		}
		out = append(out, unit{name: fmt.Sprintf("pod %s/%s of %s (above its minimum)", p.Namespace, p.Name, u.name), pods: []*v1.Pod{p}, priority: podPriority(p), order: len(out)})
		left--
		if i >= 0 {
			perRole[i]--
		}
	}
	return append(out, rest)
}
