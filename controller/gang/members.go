package gang

import (
	"fmt"
	"sort"
	"strconv"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
)

// jobIndexLabel is the completion index of an indexed Job's pod: the rank.
const jobIndexLabel = "batch.kubernetes.io/job-completion-index"

// member is one pod of a gang and its own claims.
type member struct {
	pod  *v1.Pod
	rank int
	// role is the member's role (spec.roles[].name) and roleRank its rank
	// within it; "" and 0 in a gang without roles.
	role      string
	roleIndex int
	roleRank  int
	roleSize  int
	// claims are the pod's own claims (from templates), in the pod's order;
	// the shared domain claim is not among them.
	claims []*resourceapi.ResourceClaim
}

func (m *member) ref() string { return m.pod.Namespace + "/" + m.pod.Name }

// annotations are the rank and role annotations the member's pod and claims
// carry (the kubelet plugin turns the claims' into TESSERA_GANG_* env).
func (m *member) annotations() map[string]string {
	a := map[string]string{gangv1.AnnotationRank: strconv.Itoa(m.rank)}
	if m.role != "" {
		a[gangv1.AnnotationRole] = m.role
		a[gangv1.AnnotationRoleRank] = strconv.Itoa(m.roleRank)
		a[gangv1.AnnotationRoleSize] = strconv.Itoa(m.roleSize)
	}
	return a
}

// describeRank is "rank 3", or "rank 3, workers 2" with roles.
func (m *member) describeRank() string {
	if m.role == "" {
		return fmt.Sprintf("rank %d", m.rank)
	}
	return fmt.Sprintf("rank %d, %s %d", m.rank, m.role, m.roleRank)
}

func (m *member) gated() bool { return hasGate(m.pod) }

func hasGate(p *v1.Pod) bool {
	for _, g := range p.Spec.SchedulingGates {
		if g.Name == gangv1.SchedulingGate {
			return true
		}
	}
	return false
}

// finished says whether a pod ran to an end (or is on its way out).
func finished(p *v1.Pod) bool {
	return p.DeletionTimestamp != nil || p.Status.Phase == v1.PodSucceeded || p.Status.Phase == v1.PodFailed
}

// view is what the reconciler sees of a gang's pods and claims.
type view struct {
	// live are the members that are neither finished nor being deleted,
	// ranked.
	live []*member
	// all are every member pod, finished ones included.
	all []*v1.Pod
	// domainClaim is the shared claim; nil without one (or not created yet).
	domainClaim *resourceapi.ResourceClaim
	// pending says why the members' claims are not complete yet; empty
	// when they are.
	pending string
	// invalid says why the members cannot form this gang; empty when they can.
	invalid string
	// placement is the gang's placement policy (nil: pack).
	placement *gangv1.Placement
	// roles counts the live members of each role, in spec order; nil
	// without roles.
	roles []int
	// imexBusy are the nodes an NVLink placement avoids when the plugins
	// run IMEX daemons (imexUnusable): those whose daemon serves another
	// gang's NVLink domain claim (a node serves one IMEX domain at a
	// time), and those without an InternalIP for a daemon to serve on.
	imexBusy map[string]bool
	// elastic is set for an elastic gang: a placement fits with least
	// members (and roleLeast[i] of role i's) of the live ones, those that
	// find room in rank order.
	elastic   bool
	least     int
	roleLeast []int
	roleNames []string
	// whole: an elastic gang of PodGroup pods starts with all its live
	// members (startWhole).
	whole bool
	// grow, when the view is an elastic gang's growth, are the nodes of
	// its members already placed (counted against a spread).
	grow []*v1.Node
	// held are the domains (pools) that gangs of higher priority preempted
	// pods in and wait for: this gang is not placed there meanwhile. The
	// value says so in the gang's NoDomainFits message.
	held map[string]string
	// pins are other placements' released members the scheduler has not
	// bound yet (pendingPins): a search takes their devices first.
	pins []pin
}

// claimGetter looks claims up (an informer's lister).
type claimGetter func(namespace, name string) (*resourceapi.ResourceClaim, error)

// observe collects the gang's members and claims.
func observe(g *gangv1.Gang, members gangv1.Members, pods []*v1.Pod, getClaim claimGetter) *view {
	v := &view{placement: g.Spec.Placement}
	if len(g.Spec.Roles) > 0 {
		v.roles = make([]int, len(g.Spec.Roles))
	}
	if gangv1.Elastic(&g.Spec) {
		least, _ := gangv1.Bounds(&g.Spec)
		v.elastic, v.least = true, int(least)
		for _, r := range g.Spec.Roles {
			v.roleLeast = append(v.roleLeast, int(gangv1.RoleMin(r)))
			v.roleNames = append(v.roleNames, r.Name)
		}
	}
	for _, p := range pods {
		if !members.Matches(p) {
			continue
		}
		v.all = append(v.all, p)
		if finished(p) {
			continue
		}
		m := &member{pod: p}
		if i, err := members.RoleOf(p, g.Spec.Roles); err != nil {
			if v.invalid == "" {
				v.invalid = err.Error()
			}
		} else if i >= 0 {
			r := g.Spec.Roles[i]
			m.role, m.roleIndex, m.roleSize = r.Name, i, int(r.Size)
			v.roles[i]++
		}
		v.live = append(v.live, m)
		if why := v.collectClaims(g, m, getClaim); why != "" && v.pending == "" {
			v.pending = why
		}
	}
	sort.Slice(v.all, func(i, j int) bool { return v.all[i].Name < v.all[j].Name })
	if g.Spec.DomainClaimName != "" {
		c, err := getClaim(g.Namespace, g.Spec.DomainClaimName)
		if err != nil {
			v.pending = fmt.Sprintf("domain claim %s/%s: %v; create it (class domain.gpu.tessera.dev)", g.Namespace, g.Spec.DomainClaimName, err)
		}
		v.domainClaim = c
		if why := notADomainClaim(c); why != "" && v.invalid == "" {
			v.invalid = why
		}
	}
	keep := ""
	if v.elastic {
		keep = g.Annotations[gangv1.AnnotationCommitted]
	}
	_, most := gangv1.Bounds(&g.Spec)
	v.rank(g.Spec.Roles, keep, int(most))
	return v
}

// notADomainClaim says why c cannot be a gang's domain claim: the
// controller allocates a domain claim itself, and only a domain channel,
// so every request must ask exactly for a device of class
// gangv1.DomainClass; "" when it does (or c is nil). Anything else (a GPU
// asked in a claim named as the domain) is the scheduler's to allocate.
func notADomainClaim(c *resourceapi.ResourceClaim) string {
	if c == nil {
		return ""
	}
	if len(c.Spec.Devices.Requests) == 0 {
		return fmt.Sprintf("domain claim %s/%s requests nothing: spec.domainClaimName must name a claim with one request exactly of class %s", c.Namespace, c.Name, gangv1.DomainClass)
	}
	for i, r := range c.Spec.Devices.Requests {
		if r.Exactly == nil || r.Exactly.DeviceClassName != gangv1.DomainClass {
			class := "a list of alternatives (firstAvailable)"
			if r.Exactly != nil {
				class = "class " + r.Exactly.DeviceClassName
			}
			return fmt.Sprintf("domain claim %s/%s asks in spec.devices.requests[%d] (%s) for %s: spec.domainClaimName must name a claim whose every request is exactly of class %s; request GPUs in the members' own claims", c.Namespace, c.Name, i, r.Name, class, gangv1.DomainClass)
		}
	}
	return ""
}

// startWhole makes an elastic gang's start need every live member, as a
// PodGroup's gang must: kube-scheduler (1.37) binds none of a PodGroup's
// pods while any of them is gated, so a start with members left gated would
// hold the released ones too (seen on the real scheduler:
// TestGangPlacement/AnElasticPodGroupStartsAtMinCountAndGrowsOnTheRealScheduler). Members
// created later still join by growth, and members lost are let go while
// the minimums live.
func (v *view) startWhole() {
	v.whole = true
	v.least = max(v.least, len(v.live))
	for i := range v.roleLeast {
		v.roleLeast[i] = max(v.roleLeast[i], v.roles[i])
	}
}

// short says how members (a fit of an elastic gang) fall short of the
// gang's minimums; "" when they meet them.
func (v *view) short(members []*member) string {
	if len(members) < v.least {
		return fmt.Sprintf("the gang needs at least %d (spec.minSize)", v.least)
	}
	perRole := make([]int, len(v.roleLeast))
	for _, m := range members {
		if m.role != "" {
			perRole[m.roleIndex]++
		}
	}
	for i, n := range perRole {
		if n < v.roleLeast[i] {
			return fmt.Sprintf("%d of role %s, which needs at least %d (spec.roles[%d].minSize)", n, v.roleNames[i], v.roleLeast[i], i)
		}
	}
	return ""
}

// collectClaims finds the member's own claims; it returns why they are not
// all there yet, and marks the view invalid for a pod that cannot be placed.
func (v *view) collectClaims(g *gangv1.Gang, m *member, getClaim claimGetter) string {
	sharesDomain := false
	for _, pc := range m.pod.Spec.ResourceClaims {
		var name string
		switch {
		case pc.ResourceClaimName != nil && *pc.ResourceClaimName == g.Spec.DomainClaimName:
			sharesDomain = true
			continue
		case pc.ResourceClaimName != nil:
			v.invalid = fmt.Sprintf("member %s uses claim %s, which is neither the gang's domain claim nor from a template: the gang controller allocates only the domain claim and per-pod claims from templates", m.ref(), *pc.ResourceClaimName)
			return ""
		default:
			found := false
			for _, s := range m.pod.Status.ResourceClaimStatuses {
				if s.Name == pc.Name {
					found = true
					if s.ResourceClaimName != nil {
						name = *s.ResourceClaimName
					}
				}
			}
			if !found {
				return fmt.Sprintf("the claims of member %s are not created yet (the resourceclaim controller creates them from their templates)", m.ref())
			}
			if name == "" {
				continue // the template needs no claim for this pod
			}
			if name == g.Spec.DomainClaimName {
				// A PodGroup's claim, made from a template once for the
				// whole group.
				sharesDomain = true
				continue
			}
		}
		c, err := getClaim(m.pod.Namespace, name)
		if err != nil {
			return fmt.Sprintf("claim %s/%s of member %s: %v", m.pod.Namespace, name, m.ref(), err)
		}
		if !metav1.IsControlledBy(c, m.pod) {
			v.invalid = fmt.Sprintf("member %s uses claim %s, which is not its own (another pod's, or a PodGroup claim other than the gang's domain claim): the gang controller allocates only the domain claim and per-pod claims", m.ref(), name)
			return ""
		}
		m.claims = append(m.claims, c)
	}
	if g.Spec.DomainClaimName != "" && !sharesDomain {
		v.invalid = fmt.Sprintf("member %s does not use the gang's domain claim %s: add it to the pod's resourceClaims (resourceClaimName: %s, or the PodGroup's claim entry)", m.ref(), g.Spec.DomainClaimName, g.Spec.DomainClaimName)
	}
	return ""
}

// rank numbers the live members. Without roles: by their indexed Job
// completion index when every member has a distinct one, else by pod name.
// With roles, each role is numbered so (its rank within the role), and the
// gang's ranks follow the roles' order: the first role's members first, each
// role starting after the sizes of the roles before it. When keep names a
// placement (an elastic gang's committed one), ranks are stable instead: see
// keepRanks. most is the gang's most members.
func (v *view) rank(roles []gangv1.Role, keep string, most int) {
	if len(roles) == 0 {
		byIndex := rankGroup(v.live)
		keepRanks(v.live, keep, gangv1.AnnotationRank, most, byIndex, v.succeededRanks(keep, "", gangv1.AnnotationRank))
		sort.SliceStable(v.live, func(i, j int) bool { return v.live[i].rank < v.live[j].rank })
		return
	}
	offset := map[string]int{}
	size := map[string]int{}
	next := 0
	for _, r := range roles {
		offset[r.Name], size[r.Name] = next, int(r.Size)
		next += int(r.Size)
	}
	byRole := map[string][]*member{}
	for _, m := range v.live {
		byRole[m.role] = append(byRole[m.role], m)
	}
	for role, group := range byRole {
		byIndex := rankGroup(group)
		keepRanks(group, keep, gangv1.AnnotationRoleRank, size[role], byIndex, v.succeededRanks(keep, role, gangv1.AnnotationRoleRank))
		for _, m := range group {
			m.roleRank = m.rank
			m.rank += offset[role]
		}
	}
	sort.SliceStable(v.live, func(i, j int) bool { return v.live[i].rank < v.live[j].rank })
}

// succeededRanks are the ranks (annotation key) of the pods of placement
// keep, of role, that succeeded: their ranks stay theirs.
func (v *view) succeededRanks(keep, role, key string) map[int]bool {
	out := map[int]bool{}
	if keep == "" {
		return out
	}
	for _, p := range v.all {
		if p.Annotations[gangv1.AnnotationPlacement] != keep || p.Status.Phase != v1.PodSucceeded || p.Annotations[gangv1.AnnotationRole] != role {
			continue
		}
		if r, err := strconv.Atoi(p.Annotations[key]); err == nil {
			out[r] = true
		}
	}
	return out
}

// keepRanks makes ranks stable in an elastic gang's placement keep (nothing
// when keep is ""): a member of it keeps its rank (key) for its lifetime,
// from its pod's annotation once released, or from its claims' while a
// crash left it gated with its claims written; the others take, in their
// present order, their own completion index when it is free (a Job's
// replacement pod, its predecessor's), else the lowest rank free. taken
// are the ranks of members that succeeded. Ranks stay below bound.
func keepRanks(group []*member, keep, key string, bound int, byIndex bool, taken map[int]bool) {
	if keep == "" {
		return
	}
	kept := map[*member]bool{}
	for _, m := range group {
		var raw string
		switch {
		case !m.gated() && m.pod.Annotations[gangv1.AnnotationPlacement] == keep:
			raw = m.pod.Annotations[key]
		case m.gated() && claimsOf(m, keep):
			raw = m.claims[0].Annotations[key]
		default:
			continue
		}
		r, err := strconv.Atoi(raw)
		if err != nil || r < 0 || r >= bound || taken[r] {
			continue
		}
		m.rank, kept[m], taken[r] = r, true, true
	}
	var rest []*member
	for _, m := range group {
		if kept[m] {
			continue
		}
		if byIndex && m.rank < bound && !taken[m.rank] {
			kept[m], taken[m.rank] = true, true
			continue
		}
		rest = append(rest, m)
	}
	next := 0
	for _, m := range rest {
		for taken[next] {
			next++
		}
		m.rank, taken[next] = next, true
	}
}

// rankGroup numbers members from 0: by their indexed Job completion index
// when every one has a distinct one (byIndex), else by pod name; and sorts
// them so.
func rankGroup(group []*member) (byIndex bool) {
	sort.Slice(group, func(i, j int) bool { return group[i].pod.Name < group[j].pod.Name })
	seen := map[int]bool{}
	byIndex = true
	for _, m := range group {
		idx, err := strconv.Atoi(m.pod.Labels[jobIndexLabel])
		if err != nil || seen[idx] {
			byIndex = false
			break
		}
		seen[idx] = true
		m.rank = idx
	}
	if byIndex {
		sort.Slice(group, func(i, j int) bool { return group[i].rank < group[j].rank })
		return true
	}
	for i, m := range group {
		m.rank = i
	}
	return false
}
