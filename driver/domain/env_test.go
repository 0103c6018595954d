package domain_test

import (
	"slices"
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/driver/domain"
)

func memberClaim(annotations map[string]string) *resourceapi.ResourceClaim {
	return &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "ml", Name: "w-1-gpu", Annotations: annotations}}
}

// A member's GPU claim tells its containers the gang, size and rank, and in
// a gang with roles its role, rank within the role and the role's size; a
// malformed annotation fails the prepare naming it.
func TestMemberEnvGivesRankAndRole(t *testing.T) {
	base := map[string]string{gangv1.AnnotationGang: "ml/train", gangv1.AnnotationSize: "5", gangv1.AnnotationRank: "2"}
	with := func(extra map[string]string) map[string]string {
		out := map[string]string{}
		for k, v := range base {
			out[k] = v
		}
		for k, v := range extra {
			out[k] = v
		}
		return out
	}
	for _, tc := range []struct {
		name        string
		annotations map[string]string
		want        []string
		err         string
	}{
		{"no gang", nil, nil, ""},
		{"no roles", base, []string{"TESSERA_GANG=ml/train", "TESSERA_GANG_SIZE=5", "TESSERA_GANG_RANK=2"}, ""},
		{"a worker", with(map[string]string{gangv1.AnnotationRole: "workers", gangv1.AnnotationRoleRank: "1", gangv1.AnnotationRoleSize: "4"}),
			[]string{"TESSERA_GANG=ml/train", "TESSERA_GANG_SIZE=5", "TESSERA_GANG_RANK=2", "TESSERA_GANG_ROLE=workers", "TESSERA_GANG_ROLE_RANK=1", "TESSERA_GANG_ROLE_SIZE=4"}, ""},
		{"a role rank past its size", with(map[string]string{gangv1.AnnotationRole: "workers", gangv1.AnnotationRoleRank: "4", gangv1.AnnotationRoleSize: "4"}), nil, gangv1.AnnotationRoleSize + `="4": want a number above the role rank 4`},
		{"no role rank", with(map[string]string{gangv1.AnnotationRole: "workers", gangv1.AnnotationRoleSize: "4"}), nil, gangv1.AnnotationRoleRank + `="": want a number`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env, err := domain.MemberEnv(memberClaim(tc.annotations))
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) || !strings.Contains(err.Error(), "ml/w-1-gpu") {
					t.Errorf("error %v, want one naming the claim and containing %q", err, tc.err)
				}
				return
			}
			if err != nil || !slices.Equal(env, tc.want) {
				t.Errorf("env %q, %v; want %q", env, err, tc.want)
			}
		})
	}
}
