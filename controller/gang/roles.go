package gang

import (
	"fmt"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
)

// roleCounts says why a gang with roles waits on its members' numbers: the
// first role with fewer live members than its minimum (its size, unless it
// is elastic) or more than its size ("" when every role is within its
// bounds, the gang has no roles, or its members are invalid).
func roleCounts(g *gangv1.Gang, v *view) (reason, msg string) {
	if v.invalid != "" {
		return "", ""
	}
	for i, r := range g.Spec.Roles {
		switch least := gangv1.RoleMin(r); {
		case v.roles[i] < int(least):
			return gangv1.ReasonMembersMissing, fmt.Sprintf("role %s: %d of %d members exist; the gang is placed when every role's do", r.Name, v.roles[i], least)
		case v.roles[i] > int(r.Size):
			return gangv1.ReasonTooManyMembers, fmt.Sprintf("role %s: %d pods match spec.roles[%d].selector, the role has %d: make them exactly the role's pods", r.Name, v.roles[i], i, r.Size)
		}
	}
	return "", ""
}

// byRoleLastFirst runs f for every member, the last role's members first
// (in parallel), the first role's last: workers are evicted before their
// launcher. It stops at the first role with an error. Without roles, all
// members at once.
func byRoleLastFirst(in []*member, f func(*member) error) error {
	stages := map[int][]*member{}
	last := 0
	for _, m := range in {
		stages[m.roleIndex] = append(stages[m.roleIndex], m)
		last = max(last, m.roleIndex)
	}
	for i := last; i >= 0; i-- {
		stage := stages[i]
		if err := parallel(len(stage), func(j int) error { return f(stage[j]) }); err != nil {
			return err
		}
	}
	return nil
}
