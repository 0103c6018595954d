package v1alpha1

import (
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func gangWith(size int32, p *Placement, roles ...Role) *Gang {
	return &Gang{
		ObjectMeta: metav1.ObjectMeta{Name: "g", Namespace: "ml"},
		Spec: GangSpec{Size: size, Selector: metav1.LabelSelector{MatchLabels: map[string]string{"app": "train"}},
			Placement: p, Roles: roles},
	}
}

func elastic(g *Gang, least, most int32) *Gang {
	g.Spec.MinSize, g.Spec.MaxSize = least, most
	return g
}

// Bounds are what the gang's kind says: Size twice, MinSize and MaxSize,
// or the roles' sums with a role's Size standing in for its missing
// MinSize.
func TestBoundsOfFixedElasticAndRoleGangs(t *testing.T) {
	workers := role("workers", 4)
	workers.MinSize = 2
	for _, tc := range []struct {
		g           *Gang
		least, most int32
		elastic     bool
	}{
		{gangWith(3, nil), 3, 3, false},
		{elastic(gangWith(0, nil), 2, 6), 2, 6, true},
		{elastic(gangWith(0, nil), 4, 4), 4, 4, false},
		{gangWith(5, nil, role("launcher", 1), role("workers", 4)), 5, 5, false},
		{gangWith(5, nil, role("launcher", 1), workers), 3, 5, true},
	} {
		least, most := Bounds(&tc.g.Spec)
		if least != tc.least || most != tc.most || Elastic(&tc.g.Spec) != tc.elastic {
			t.Errorf("%+v: bounds %d..%d elastic %v, want %d..%d %v", tc.g.Spec, least, most, Elastic(&tc.g.Spec), tc.least, tc.most, tc.elastic)
		}
	}
}

func role(name string, size int32) Role {
	return Role{Name: name, Size: size, Selector: metav1.LabelSelector{MatchLabels: map[string]string{"role": name}}}
}

// Every invalid placement policy or role list is refused with the field and
// what to write instead.
func TestValidateNamesTheFieldAndTheFixOfPoliciesAndRoles(t *testing.T) {
	for _, tc := range []struct {
		name string
		g    *Gang
		want string // "" for valid
	}{
		{"no policy", gangWith(2, nil), ""},
		{"pack", gangWith(2, &Placement{Policy: PolicyPack}), ""},
		{"spread", gangWith(2, &Placement{Policy: PolicySpread, TopologyKey: "example.com/rack", MaxPerValue: 1, Strength: StrengthPreferred}), ""},
		{"unknown policy", gangWith(2, &Placement{Policy: "Scatter"}), `spec.placement.policy "Scatter": want Pack`},
		{"unknown strength", gangWith(2, &Placement{Strength: "Soft"}), `spec.placement.strength "Soft": want Required or Preferred`},
		{"spread without key", gangWith(2, &Placement{Policy: PolicySpread, MaxPerValue: 1}), "spec.placement.topologyKey is empty"},
		{"spread with a bad key", gangWith(2, &Placement{Policy: PolicySpread, TopologyKey: "no spaces", MaxPerValue: 1}), `spec.placement.topologyKey "no spaces" is not a label key`},
		{"spread without max", gangWith(2, &Placement{Policy: PolicySpread, TopologyKey: "rack"}), "spec.placement.maxPerValue 0: policy Spread needs at least 1"},
		{"pack with a key", gangWith(2, &Placement{TopologyKey: "rack"}), "apply to policy Spread only"},
		{"roles", gangWith(5, nil, role("launcher", 1), role("workers", 4)), ""},
		{"roles not summing to size", gangWith(4, nil, role("launcher", 1), role("workers", 4)), "spec.size 4 is not the sum of the roles' sizes (5): set spec.size to 5"},
		{"role without members", gangWith(1, nil, role("launcher", 1), role("workers", 0)), "spec.roles[1] (workers).size 0: want at least 1"},
		{"role named twice", gangWith(2, nil, role("w", 1), role("w", 1)), `spec.roles[1].name "w": another role has that name`},
		{"role name not a label", gangWith(1, nil, role("Workers", 1)), `spec.roles[0].name "Workers"`},
		{"role selecting everything", gangWith(1, nil, Role{Name: "w", Size: 1}), "spec.roles[0] (w).selector is empty"},
		{"roles of a PodGroup", &Gang{Spec: GangSpec{Size: 1, PodGroupName: "pg", Roles: []Role{role("w", 1)}}}, "spec.roles with spec.podGroupName"},
		{"composite", composite(pgRole("prefill", 2), pgRole("decode", 4)), ""},
		{"composite without roles", func() *Gang { g := composite(); g.Spec.Size = 1; return g }(), "spec.compositePodGroupName without spec.roles"},
		{"composite with a selector", func() *Gang { g := composite(pgRole("a", 1)); g.Spec.Selector = role("a", 1).Selector; return g }(), "keep compositePodGroupName alone"},
		{"composite role with a selector", composite(Role{Name: "a", Size: 1, PodGroupName: "a", Selector: role("a", 1).Selector}), "spec.roles[0] (a): a CompositePodGroup's role is one child PodGroup; set podGroupName and no selector"},
		{"composite role without a PodGroup", composite(Role{Name: "a", Size: 1}), "set podGroupName and no selector"},
		{"composite roles sharing a PodGroup", composite(pgRole("a", 1), Role{Name: "b", Size: 1, PodGroupName: "a"}), `spec.roles[1] (b).podGroupName "a": another role has that PodGroup`},
		{"a PodGroup role outside a composite", gangWith(1, nil, Role{Name: "a", Size: 1, PodGroupName: "a", Selector: role("a", 1).Selector}), "spec.roles[0] (a).podGroupName is for the gang of a CompositePodGroup"},
		{"elastic", elastic(gangWith(0, nil), 2, 4), ""},
		{"elastic with a size", elastic(gangWith(4, nil), 2, 4), "spec.size 4 with spec.minSize and spec.maxSize"},
		{"elastic without a maximum", elastic(gangWith(0, nil), 2, 0), "spec.minSize 2 and spec.maxSize 0: want 1 <= minSize <= maxSize"},
		{"elastic upside down", elastic(gangWith(0, nil), 4, 2), "want 1 <= minSize <= maxSize"},
		{"neither size nor bounds", gangWith(0, nil), "spec.size 0: want at least 1 (or spec.minSize and spec.maxSize"},
		{"elastic role", gangWith(5, nil, role("launcher", 1), Role{Name: "workers", Size: 4, MinSize: 2, Selector: role("workers", 4).Selector}), ""},
		{"elastic role above its size", gangWith(5, nil, role("launcher", 1), Role{Name: "workers", Size: 4, MinSize: 5, Selector: role("workers", 4).Selector}), "spec.roles[1] (workers).minSize 5: want 1 to the role's size 4"},
		{"gang bounds with roles", elastic(gangWith(0, nil, role("launcher", 1), role("workers", 4)), 2, 5), "spec.minSize and spec.maxSize with spec.roles: make a role elastic with spec.roles[].minSize"},
		{"elastic over a domain claim's limit", func() *Gang { g := elastic(gangWith(0, nil), 2, 300); g.Spec.DomainClaimName = "d"; return g }(), "size 300 with spec.domainClaimName"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Validate(tc.g)
			switch {
			case tc.want == "" && err != nil:
				t.Errorf("refused: %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Errorf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

// composite is the gang of CompositePodGroup "serve" with the given roles.
func composite(roles ...Role) *Gang {
	g := &Gang{ObjectMeta: metav1.ObjectMeta{Name: "serve", Namespace: "ml"}, Spec: GangSpec{CompositePodGroupName: "serve", Roles: roles}}
	for _, r := range roles {
		g.Spec.Size += r.Size
	}
	return g
}

// pgRole is a role made of the PodGroup of its name.
func pgRole(name string, size int32) Role {
	return Role{Name: name, Size: size, PodGroupName: name}
}

// A CompositePodGroup's gang takes the pods of its children's PodGroups, each
// into the role of its PodGroup, whatever their labels; pods of other
// PodGroups, or of none, are not members.
func TestACompositeGangsMembersAreThePodsOfItsChildPodGroups(t *testing.T) {
	g := composite(pgRole("prefill", 1), pgRole("decode", 2))
	m, err := Validate(g)
	if err != nil {
		t.Fatal(err)
	}
	pod := func(group string) *corev1.Pod {
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p-" + group, Namespace: "ml", Labels: map[string]string{"role": "prefill"}}}
		if group != "" {
			p.Spec.SchedulingGroup = &corev1.PodSchedulingGroup{PodGroupName: &group}
		}
		return p
	}
	for _, tc := range []struct {
		group  string
		member bool
		role   int
	}{{"prefill", true, 0}, {"decode", true, 1}, {"other", false, -1}, {"", false, -1}} {
		p := pod(tc.group)
		if got := m.Matches(p); got != tc.member {
			t.Errorf("pod of PodGroup %q: member %v, want %v", tc.group, got, tc.member)
		}
		i, err := m.RoleOf(p, g.Spec.Roles)
		if i != tc.role || (err == nil) != tc.member {
			t.Errorf("pod of PodGroup %q: role %d, %v; want %d", tc.group, i, err, tc.role)
		}
		if err != nil && !strings.Contains(err.Error(), "set its spec.schedulingGroup.podGroupName to one of prefill, decode") {
			t.Errorf("pod of PodGroup %q: %v does not say which PodGroups the roles are", tc.group, err)
		}
	}
}

func TestRoleOfSortsMembersIntoExactlyOneRole(t *testing.T) {
	g := gangWith(3, nil, role("launcher", 1), Role{Name: "workers", Size: 2, Selector: metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{{Key: "role", Operator: metav1.LabelSelectorOpIn, Values: []string{"workers", "both"}}}}})
	m, err := Validate(g)
	if err != nil {
		t.Fatal(err)
	}
	pod := func(role string) *corev1.Pod {
		return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p-" + role, Namespace: "ml", Labels: map[string]string{"app": "train", "role": role}}}
	}
	if i, err := m.RoleOf(pod("workers"), g.Spec.Roles); i != 1 || err != nil {
		t.Errorf("a worker: role %d, %v; want 1", i, err)
	}
	if i, err := m.RoleOf(pod("launcher"), g.Spec.Roles); i != 0 || err != nil {
		t.Errorf("the launcher: role %d, %v; want 0", i, err)
	}
	if _, err := m.RoleOf(pod("none"), g.Spec.Roles); err == nil || !strings.Contains(err.Error(), "matches no role") {
		t.Errorf("a member of no role: %v", err)
	}
	g.Spec.Roles[0].Selector = metav1.LabelSelector{MatchLabels: map[string]string{"app": "train"}}
	if m, err = Validate(g); err != nil {
		t.Fatal(err)
	}
	if _, err := m.RoleOf(pod("workers"), g.Spec.Roles); err == nil || !strings.Contains(err.Error(), "roles launcher and workers") {
		t.Errorf("a member of two roles: %v", err)
	}
	plain, _ := Validate(gangWith(1, nil))
	if i, err := plain.RoleOf(pod("x"), nil); i != -1 || err != nil {
		t.Errorf("a gang without roles: %d, %v; want -1", i, err)
	}
}
