package v1alpha1

import (
	"fmt"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/validation"
)

// Members picks a gang's pods, by label selector or by PodGroup, and sorts
// them into the gang's roles.
type Members struct {
	selector labels.Selector
	podGroup string
	roles    []labels.Selector
	// rolePodGroups are the PodGroups of a CompositePodGroup's gang, one
	// per role in spec.roles order.
	rolePodGroups []string
}

// podGroupOf is the PodGroup pod p joins (spec.schedulingGroup), or "".
func podGroupOf(p *corev1.Pod) string {
	if p.Spec.SchedulingGroup == nil || p.Spec.SchedulingGroup.PodGroupName == nil {
		return ""
	}
	return *p.Spec.SchedulingGroup.PodGroupName
}

// RoleOf is the index (in spec.roles) of the role member p belongs to: -1 in
// a gang without roles, an error naming the pod when it matches no role or
// more than one.
func (m Members) RoleOf(p *corev1.Pod, roles []Role) (int, error) {
	if len(m.rolePodGroups) > 0 {
		if i := slices.Index(m.rolePodGroups, podGroupOf(p)); i >= 0 {
			return i, nil
		}
		return -1, fmt.Errorf("member %s/%s joins no role's PodGroup: set its spec.schedulingGroup.podGroupName to one of %s", p.Namespace, p.Name, strings.Join(m.rolePodGroups, ", "))
	}
	if len(m.roles) == 0 {
		return -1, nil
	}
	found := -1
	for i, sel := range m.roles {
		if !sel.Matches(labels.Set(p.Labels)) {
			continue
		}
		if found >= 0 {
			return -1, fmt.Errorf("member %s/%s matches the selectors of roles %s and %s: make the roles' selectors pick disjoint pods", p.Namespace, p.Name, roles[found].Name, roles[i].Name)
		}
		found = i
	}
	if found < 0 {
		return -1, fmt.Errorf("member %s/%s matches no role's selector: give it the labels of one role (spec.roles[].selector), or leave it out of spec.selector", p.Namespace, p.Name)
	}
	return found, nil
}

// PlacementOf is the gang's placement policy with its defaults filled in.
func PlacementOf(s *GangSpec) Placement {
	var p Placement
	if s.Placement != nil {
		p = *s.Placement
	}
	if p.Policy == "" {
		p.Policy = PolicyPack
	}
	if p.Strength == "" {
		p.Strength = StrengthRequired
	}
	return p
}

// validatePlacement checks spec.placement.
func validatePlacement(p *Placement) error {
	if p == nil {
		return nil
	}
	switch p.Strength {
	case "", StrengthRequired, StrengthPreferred:
	default:
		return fmt.Errorf("spec.placement.strength %q: want %s or %s (default %s)", p.Strength, StrengthRequired, StrengthPreferred, StrengthRequired)
	}
	switch p.Policy {
	case "", PolicyPack:
		if p.TopologyKey != "" || p.MaxPerValue != 0 {
			return fmt.Errorf("spec.placement.topologyKey and maxPerValue apply to policy %s only: set policy: %s, or drop them to pack", PolicySpread, PolicySpread)
		}
	case PolicySpread:
		if p.TopologyKey == "" {
			return fmt.Errorf("spec.placement.topologyKey is empty: policy %s needs the node label to spread over (e.g. a rack label, or kubernetes.io/hostname)", PolicySpread)
		}
		if errs := validation.IsQualifiedName(p.TopologyKey); len(errs) > 0 {
			return fmt.Errorf("spec.placement.topologyKey %q is not a label key: %s", p.TopologyKey, errs[0])
		}
		if p.MaxPerValue < 1 {
			return fmt.Errorf("spec.placement.maxPerValue %d: policy %s needs at least 1 (the most members on the nodes of one value of %s)", p.MaxPerValue, PolicySpread, p.TopologyKey)
		}
	default:
		return fmt.Errorf("spec.placement.policy %q: want %s (default: the smallest domain, fewest nodes) or %s (at most maxPerValue members per value of topologyKey)", p.Policy, PolicyPack, PolicySpread)
	}
	return nil
}

// validateRoles checks spec.roles and compiles their selectors.
func validateRoles(g *Gang) ([]labels.Selector, error) {
	if len(g.Spec.Roles) == 0 {
		return nil, nil
	}
	if g.Spec.PodGroupName != "" {
		return nil, fmt.Errorf("spec.roles with spec.podGroupName: a PodGroup's gang has no roles; pick the members with spec.selector instead")
	}
	if len(g.Spec.Roles) > MaxRoles {
		return nil, fmt.Errorf("spec.roles has %d roles: a gang has at most %d; merge roles whose members need the same devices", len(g.Spec.Roles), MaxRoles)
	}
	composite := g.Spec.CompositePodGroupName != ""
	var sels []labels.Selector
	seen := map[string]bool{}
	var sum int32
	for i, r := range g.Spec.Roles {
		if errs := validation.IsDNS1123Label(r.Name); len(errs) > 0 {
			return nil, fmt.Errorf("spec.roles[%d].name %q: %s", i, r.Name, errs[0])
		}
		if seen[r.Name] {
			return nil, fmt.Errorf("spec.roles[%d].name %q: another role has that name; give each role its own", i, r.Name)
		}
		seen[r.Name] = true
		if r.Size < 1 {
			return nil, fmt.Errorf("spec.roles[%d] (%s).size %d: want at least 1", i, r.Name, r.Size)
		}
		if r.MinSize < 0 || r.MinSize > r.Size {
			return nil, fmt.Errorf("spec.roles[%d] (%s).minSize %d: want 1 to the role's size %d (or leave it out: the role is not elastic)", i, r.Name, r.MinSize, r.Size)
		}
		sum += r.Size
		sel, err := metav1.LabelSelectorAsSelector(&r.Selector)
		if err != nil {
			return nil, fmt.Errorf("spec.roles[%d] (%s).selector: %w", i, r.Name, err)
		}
		switch {
		case composite && (r.PodGroupName == "" || !sel.Empty()):
			return nil, fmt.Errorf("spec.roles[%d] (%s): a CompositePodGroup's role is one child PodGroup; set podGroupName and no selector", i, r.Name)
		case composite && seen["podgroup/"+r.PodGroupName]:
			return nil, fmt.Errorf("spec.roles[%d] (%s).podGroupName %q: another role has that PodGroup; give each role its own", i, r.Name, r.PodGroupName)
		case composite:
			seen["podgroup/"+r.PodGroupName] = true
			continue
		case r.PodGroupName != "":
			return nil, fmt.Errorf("spec.roles[%d] (%s).podGroupName is for the gang of a CompositePodGroup (spec.compositePodGroupName): pick the role's members with selector", i, r.Name)
		case sel.Empty():
			return nil, fmt.Errorf("spec.roles[%d] (%s).selector is empty and would pick every member: select the role's pods by a label (e.g. the job-name of the role's Job)", i, r.Name)
		}
		sels = append(sels, sel)
	}
	if g.Spec.MinSize != 0 || g.Spec.MaxSize != 0 {
		return nil, fmt.Errorf("spec.minSize and spec.maxSize with spec.roles: make a role elastic with spec.roles[].minSize, and set spec.size to the sum of the roles' sizes (%d)", sum)
	}
	if sum != g.Spec.Size {
		return nil, fmt.Errorf("spec.size %d is not the sum of the roles' sizes (%d): set spec.size to %d", g.Spec.Size, sum, sum)
	}
	return sels, nil
}

// Matches says whether the pod (of the gang's namespace) is a member.
func (m Members) Matches(p *corev1.Pod) bool {
	if len(m.rolePodGroups) > 0 {
		return slices.Contains(m.rolePodGroups, podGroupOf(p))
	}
	if m.podGroup != "" {
		return podGroupOf(p) == m.podGroup
	}
	return m.selector != nil && m.selector.Matches(labels.Set(p.Labels))
}

// Validate checks a gang's spec beyond what the CRD schema checks, and
// returns how it picks its members. Errors name the field and the fix.
func Validate(g *Gang) (Members, error) {
	if err := validateSize(&g.Spec); err != nil {
		return Members{}, fmt.Errorf("gang %s/%s: %w", g.Namespace, g.Name, err)
	}
	if err := validatePlacement(g.Spec.Placement); err != nil {
		return Members{}, fmt.Errorf("gang %s/%s: %w", g.Namespace, g.Name, err)
	}
	roles, err := validateRoles(g)
	if err != nil {
		return Members{}, fmt.Errorf("gang %s/%s: %w", g.Namespace, g.Name, err)
	}
	sel, err := metav1.LabelSelectorAsSelector(&g.Spec.Selector)
	if err != nil {
		return Members{}, fmt.Errorf("gang %s/%s: spec.selector: %w", g.Namespace, g.Name, err)
	}
	switch {
	case g.Spec.CompositePodGroupName != "" && (g.Spec.PodGroupName != "" || !sel.Empty()):
		return Members{}, fmt.Errorf("gang %s/%s: spec.compositePodGroupName with spec.selector or spec.podGroupName; keep compositePodGroupName alone (its roles name the child PodGroups)", g.Namespace, g.Name)
	case g.Spec.CompositePodGroupName != "" && len(g.Spec.Roles) == 0:
		return Members{}, fmt.Errorf("gang %s/%s: spec.compositePodGroupName without spec.roles: give each child PodGroup a role (spec.roles[].podGroupName)", g.Namespace, g.Name)
	case g.Spec.CompositePodGroupName != "":
		m := Members{}
		for _, r := range g.Spec.Roles {
			m.rolePodGroups = append(m.rolePodGroups, r.PodGroupName)
		}
		return m, nil
	case g.Spec.PodGroupName != "" && !sel.Empty():
		return Members{}, fmt.Errorf("gang %s/%s: spec.selector and spec.podGroupName are both set; keep one (podGroupName: the pods of that PodGroup)", g.Namespace, g.Name)
	case g.Spec.PodGroupName != "":
		return Members{podGroup: g.Spec.PodGroupName}, nil
	case sel.Empty():
		return Members{}, fmt.Errorf("gang %s/%s: spec.selector is empty and would select every pod of the namespace; select the members by a label (e.g. job-name), or name a PodGroup (spec.podGroupName)", g.Namespace, g.Name)
	}
	return Members{selector: sel, roles: roles}, nil
}

// validateSize checks spec.size, or spec.minSize and spec.maxSize.
func validateSize(s *GangSpec) error {
	elastic := s.MinSize != 0 || s.MaxSize != 0
	switch {
	case elastic && s.Size != 0:
		return fmt.Errorf("spec.size %d with spec.minSize and spec.maxSize: set size for a fixed gang, or minSize and maxSize for an elastic one", s.Size)
	case elastic && (s.MinSize < 1 || s.MaxSize < s.MinSize):
		return fmt.Errorf("spec.minSize %d and spec.maxSize %d: want 1 <= minSize <= maxSize", s.MinSize, s.MaxSize)
	case !elastic && s.Size < 1:
		return fmt.Errorf("spec.size %d: want at least 1 (or spec.minSize and spec.maxSize for an elastic gang)", s.Size)
	}
	if _, most := Bounds(s); s.DomainClaimName != "" && most > MaxSizeWithDomainClaim {
		return fmt.Errorf("size %d with spec.domainClaimName: a claim is reserved for at most %d pods; leave domainClaimName empty for a larger gang (it is still placed in one domain, without a channel)", most, MaxSizeWithDomainClaim)
	}
	return nil
}

// Bounds are the fewest members a gang is placed with (and goes on with)
// and the most it has: Size and Size for a fixed gang; MinSize and MaxSize
// for an elastic one; with roles, the sums of the roles' minimums (a role
// without MinSize counts its Size) and of their sizes.
func Bounds(s *GangSpec) (least, most int32) {
	switch {
	case len(s.Roles) > 0:
		for _, r := range s.Roles {
			least += RoleMin(r)
			most += r.Size
		}
		return least, most
	case s.MinSize != 0 || s.MaxSize != 0:
		return s.MinSize, s.MaxSize
	}
	return s.Size, s.Size
}

// RoleMin is the fewest members of role r a placement needs: MinSize, or
// Size when it is not set.
func RoleMin(r Role) int32 {
	if r.MinSize > 0 {
		return r.MinSize
	}
	return r.Size
}

// Elastic says whether a gang may be placed, and go on, with fewer members
// than its most.
func Elastic(s *GangSpec) bool {
	least, most := Bounds(s)
	return least < most
}
