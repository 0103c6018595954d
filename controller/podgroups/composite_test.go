package podgroups_test

import (
	"strconv"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	schedulingv1alpha3 "k8s.io/api/scheduling/v1alpha3"
	schedulingv1beta1 "k8s.io/api/scheduling/v1beta1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/controller/podgroups"
)

// serve is CompositePodGroup ml/serve with a gang policy of minGroupCount 2.
func serve(mut func(*schedulingv1alpha3.CompositePodGroup)) *schedulingv1alpha3.CompositePodGroup {
	cpg := &schedulingv1alpha3.CompositePodGroup{
		ObjectMeta: metav1.ObjectMeta{Name: "serve", Namespace: "ml", UID: "cpg-1"},
		Spec: schedulingv1alpha3.CompositePodGroupSpec{SchedulingPolicy: schedulingv1alpha3.CompositePodGroupSchedulingPolicy{
			Gang: &schedulingv1alpha3.CompositeGangSchedulingPolicy{MinGroupCount: 2},
		}},
	}
	if mut != nil {
		mut(cpg)
	}
	return cpg
}

// child is a PodGroup of serve with minCount members and the named domain
// claim ("" for none).
func child(name string, minCount, priority int32, domain string, mut func(*schedulingv1beta1.PodGroup)) *schedulingv1beta1.PodGroup {
	pg := &schedulingv1beta1.PodGroup{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ml", UID: types.UID("pg-" + name)},
		Spec: schedulingv1beta1.PodGroupSpec{
			ParentCompositePodGroupName: ptr.To("serve"),
			SchedulingPolicy:            schedulingv1beta1.PodGroupSchedulingPolicy{Gang: &schedulingv1beta1.GangSchedulingPolicy{MinCount: minCount}},
			Priority:                    ptr.To(priority),
		},
	}
	if domain != "" {
		pg.Spec.ResourceClaims = []schedulingv1beta1.PodGroupResourceClaim{{Name: "domain", ResourceClaimName: ptr.To(domain)}}
	}
	if mut != nil {
		mut(pg)
	}
	return pg
}

// A CompositePodGroup with a gang policy is one gang whose roles are its
// child PodGroups, in priority order (the lowest-priority child's pods are
// evicted first), each as large as its minCount (elastic to its max-size),
// sharing the one domain claim its children name; what cannot be mapped
// waits with the reason, and what is not Tessera's is left alone.
func TestDesiredGangOfACompositePodGroup(t *testing.T) {
	elasticDecode := func(pg *schedulingv1beta1.PodGroup) {
		pg.Annotations = map[string]string{gangv1.AnnotationMaxSize: "6"}
	}
	both := []*schedulingv1beta1.PodGroup{child("decode", 4, 0, "fixed-domain", elasticDecode), child("prefill", 2, 100, "fixed-domain", nil)}
	for _, tc := range []struct {
		name     string
		cpg      *schedulingv1alpha3.CompositePodGroup
		children []*schedulingv1beta1.PodGroup
		nested   []string
		// roles are the gang's roles as name:size[:minSize]; nil for no gang.
		roles  []string
		domain string
		why    string // a part of the reason there is no gang yet
	}{
		{"prefill and decode sharing a domain claim", serve(nil), both, nil, []string{"prefill:2", "decode:6:4"}, "fixed-domain", ""},
		{"one child without the claim", serve(nil), []*schedulingv1beta1.PodGroup{child("launcher", 1, 10, "", nil), child("workers", 4, 0, "fixed-domain", nil)}, nil, []string{"launcher:1", "workers:4"}, "fixed-domain", ""},
		{"equal priorities by name", serve(nil), []*schedulingv1beta1.PodGroup{child("b", 1, 0, "fixed-domain", nil), child("a", 1, 0, "fixed-domain", nil)}, nil, []string{"a:1", "b:1"}, "fixed-domain", ""},
		{"managed without a domain claim", serve(func(c *schedulingv1alpha3.CompositePodGroup) {
			c.Annotations = map[string]string{gangv1.AnnotationManaged: "true"}
		}), []*schedulingv1beta1.PodGroup{child("a", 1, 0, "", nil), child("b", 2, 0, "", nil)}, nil, []string{"a:1", "b:2"}, "", ""},
		{"no domain claim is the scheduler's", serve(nil), []*schedulingv1beta1.PodGroup{child("a", 1, 0, "", nil), child("b", 2, 0, "", nil)}, nil, nil, "", ""},
		{"a claim of another class is the scheduler's", serve(nil), []*schedulingv1beta1.PodGroup{child("a", 1, 0, "shared-data", nil), child("b", 2, 0, "", nil)}, nil, nil, "", ""},
		{"a basic policy is the scheduler's", serve(func(c *schedulingv1alpha3.CompositePodGroup) {
			c.Spec.SchedulingPolicy = schedulingv1alpha3.CompositePodGroupSchedulingPolicy{Basic: &schedulingv1alpha3.CompositeBasicSchedulingPolicy{}}
		}), both, nil, nil, "", ""},
		{"being deleted", serve(func(c *schedulingv1alpha3.CompositePodGroup) { c.DeletionTimestamp = &metav1.Time{} }), both, nil, nil, "", ""},
		{"two domain claims", serve(nil), []*schedulingv1beta1.PodGroup{child("a", 1, 0, "fixed-domain", nil), child("b", 1, 0, "other-domain", nil)}, nil, nil, "", "child PodGroups a and b name different domain claims (fixed-domain and other-domain)"},
		{"a child's claim missing", serve(nil), []*schedulingv1beta1.PodGroup{child("a", 1, 0, "gone", nil), child("b", 1, 0, "fixed-domain", nil)}, nil, nil, "", "child PodGroup a: group claim domain (gone)"},
		{"fewer children than minGroupCount", serve(nil), both[:1], nil, nil, "", "1 child PodGroups exist, the gang policy's minGroupCount is 2"},
		{"a child being deleted does not count", serve(nil), []*schedulingv1beta1.PodGroup{both[0], child("prefill", 2, 100, "fixed-domain", func(pg *schedulingv1beta1.PodGroup) { pg.DeletionTimestamp = &metav1.Time{} })}, nil, nil, "", "1 child PodGroups exist"},
		{"a child without a gang policy", serve(nil), []*schedulingv1beta1.PodGroup{both[0], child("prefill", 2, 100, "", func(pg *schedulingv1beta1.PodGroup) {
			pg.Spec.SchedulingPolicy = schedulingv1beta1.PodGroupSchedulingPolicy{Basic: &schedulingv1beta1.BasicSchedulingPolicy{}}
		})}, nil, nil, "", "child PodGroup prefill has no gang policy"},
		{"a child whose name is no role name", serve(nil), []*schedulingv1beta1.PodGroup{both[0], child("pre.fill", 2, 0, "", nil)}, nil, nil, "", "child PodGroup pre.fill: its name is its role's name, which must be a DNS label"},
		{"a child's max-size below its minCount", serve(nil), []*schedulingv1beta1.PodGroup{both[1], child("decode", 4, 0, "", func(pg *schedulingv1beta1.PodGroup) {
			pg.Annotations = map[string]string{gangv1.AnnotationMaxSize: "3"}
		})}, nil, nil, "", "PodGroup decode: annotation gang.tessera.dev/max-size=\"3\""},
		{"nested CompositePodGroups", serve(nil), both, []string{"inner"}, nil, "", "its children include CompositePodGroups (inner)"},
		{"a nested CompositePodGroup", serve(func(c *schedulingv1alpha3.CompositePodGroup) { c.Spec.ParentCompositePodGroupName = ptr.To("outer") }), both, nil, nil, "", "it is a child of CompositePodGroup outer"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g, why := podgroups.DesiredComposite(tc.cpg, tc.children, tc.nested, getClaim)
			if !strings.Contains(why, tc.why) || (tc.why == "") != (why == "") {
				t.Errorf("reason %q, want one with %q", why, tc.why)
			}
			if tc.roles == nil {
				if g != nil {
					t.Fatalf("gang %+v, want none", g.Spec)
				}
				return
			}
			if g == nil {
				t.Fatalf("no gang (%s)", why)
			}
			var roles []string
			for _, r := range g.Spec.Roles {
				s := r.Name + ":" + itoa(r.Size)
				if r.MinSize != 0 {
					s += ":" + itoa(r.MinSize)
				}
				if r.PodGroupName != r.Name {
					t.Errorf("role %s is the pods of PodGroup %q, want its own", r.Name, r.PodGroupName)
				}
				roles = append(roles, s)
			}
			if strings.Join(roles, ",") != strings.Join(tc.roles, ",") || g.Spec.DomainClaimName != tc.domain || g.Spec.CompositePodGroupName != "serve" || g.Name != "serve" || g.Namespace != "ml" {
				t.Errorf("gang %s/%s of %q: roles %v, domain claim %q; want ml/serve of serve, roles %v, domain claim %q", g.Namespace, g.Name, g.Spec.CompositePodGroupName, roles, g.Spec.DomainClaimName, tc.roles, tc.domain)
			}
			if o := metav1.GetControllerOf(g); o == nil || o.Kind != "CompositePodGroup" || o.APIVersion != "scheduling.k8s.io/v1alpha3" || o.UID != tc.cpg.UID {
				t.Errorf("gang controller %+v, want the CompositePodGroup", o)
			}
			// The gang is valid as written, and its members are the
			// children's pods, each in its PodGroup's role.
			members, err := gangv1.Validate(g)
			if err != nil {
				t.Fatal(err)
			}
			for i, r := range g.Spec.Roles {
				p := &corev1.Pod{Spec: corev1.PodSpec{SchedulingGroup: &corev1.PodSchedulingGroup{PodGroupName: ptr.To(r.PodGroupName)}}}
				if got, err := members.RoleOf(p, g.Spec.Roles); !members.Matches(p) || got != i || err != nil {
					t.Errorf("a pod of PodGroup %s: member %v, role %d (%v); want role %d", r.PodGroupName, members.Matches(p), got, err, i)
				}
			}
			if other := (&corev1.Pod{Spec: corev1.PodSpec{SchedulingGroup: &corev1.PodSchedulingGroup{PodGroupName: ptr.To("eval")}}}); members.Matches(other) {
				t.Error("a pod of another PodGroup is a member")
			}
		})
	}
}

func itoa(n int32) string { return strconv.Itoa(int(n)) }
