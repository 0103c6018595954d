package podgroups_test

import (
	"fmt"
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

// serve is CompositePodGroup ml/serve with a gang policy of minGroupCount
// 2, made from template "serve" of Workload "wl".
func serve(mut func(*schedulingv1alpha3.CompositePodGroup)) *schedulingv1alpha3.CompositePodGroup {
	cpg := &schedulingv1alpha3.CompositePodGroup{
		ObjectMeta: metav1.ObjectMeta{Name: "serve", Namespace: "ml", UID: "cpg-1"},
		Spec: schedulingv1alpha3.CompositePodGroupSpec{
			WorkloadRef: &schedulingv1alpha3.WorkloadReference{WorkloadName: "wl", TemplateName: "serve"},
			SchedulingPolicy: schedulingv1alpha3.CompositePodGroupSchedulingPolicy{
				Gang: &schedulingv1alpha3.CompositeGangSchedulingPolicy{MinGroupCount: 2},
			},
		},
	}
	if mut != nil {
		mut(cpg)
	}
	return cpg
}

// workload is Workload ml/wl, whose CompositePodGroup template "serve" lists
// the PodGroup templates prefill, decode, launcher, workers, a and b, in
// that order.
func workload(_, name string) (*schedulingv1beta1.Workload, error) {
	if name != "wl" {
		return nil, fmt.Errorf("workload %q not found", name)
	}
	w := &schedulingv1beta1.Workload{ObjectMeta: metav1.ObjectMeta{Name: "wl", Namespace: "ml"}}
	serve := schedulingv1beta1.CompositePodGroupTemplate{Name: "serve"}
	for _, n := range []string{"prefill", "decode", "launcher", "workers", "a", "b"} {
		serve.PodGroupTemplates = append(serve.PodGroupTemplates, schedulingv1beta1.PodGroupTemplate{Name: n})
	}
	w.Spec.CompositePodGroupTemplates = []schedulingv1beta1.CompositePodGroupTemplate{{Name: "other"}, serve}
	return w, nil
}

var look = podgroups.Lookups{Claim: getClaim, Workload: workload}

// child is a PodGroup of serve made from the Workload's template of its
// name, with minCount members and the named domain claim ("" for none).
func child(name string, minCount int32, domain string, mut func(*schedulingv1beta1.PodGroup)) *schedulingv1beta1.PodGroup {
	pg := &schedulingv1beta1.PodGroup{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ml", UID: types.UID("pg-" + name)},
		Spec: schedulingv1beta1.PodGroupSpec{
			ParentCompositePodGroupName: ptr.To("serve"),
			WorkloadRef:                 &schedulingv1beta1.WorkloadReference{WorkloadName: "wl", TemplateName: name},
			SchedulingPolicy:            schedulingv1beta1.PodGroupSchedulingPolicy{Gang: &schedulingv1beta1.GangSchedulingPolicy{MinCount: minCount}},
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
// child PodGroups, in the order of their templates in the Workload (the last
// template's pods are evicted first), each as large as its minCount (elastic
// to its max-size), sharing the one domain claim its children name; what
// cannot be mapped waits with the reason, and what is not Tessera's is left
// alone.
func TestDesiredGangOfACompositePodGroup(t *testing.T) {
	elasticDecode := func(pg *schedulingv1beta1.PodGroup) {
		pg.Annotations = map[string]string{gangv1.AnnotationMaxSize: "6"}
	}
	both := []*schedulingv1beta1.PodGroup{child("decode", 4, "fixed-domain", elasticDecode), child("prefill", 2, "fixed-domain", nil)}
	ofTemplate := func(tmpl string) func(*schedulingv1beta1.PodGroup) {
		return func(pg *schedulingv1beta1.PodGroup) { pg.Spec.WorkloadRef.TemplateName = tmpl }
	}
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
		{"launcher and workers", serve(nil), []*schedulingv1beta1.PodGroup{child("workers", 4, "fixed-domain", nil), child("launcher", 1, "fixed-domain", nil)}, nil, []string{"launcher:1", "workers:4"}, "fixed-domain", ""},
		{"one child without the claim", serve(nil), []*schedulingv1beta1.PodGroup{child("workers", 4, "fixed-domain", nil), child("launcher", 1, "", nil)}, nil, nil, "", "child PodGroup launcher names no domain claim where workers names fixed-domain"},
		{"children of one template by name", serve(nil), []*schedulingv1beta1.PodGroup{child("decode-1", 1, "fixed-domain", ofTemplate("decode")), child("decode-0", 1, "fixed-domain", ofTemplate("decode")), child("prefill", 1, "fixed-domain", nil)}, nil, []string{"prefill:1", "decode-0:1", "decode-1:1"}, "fixed-domain", ""},
		{"managed without a domain claim", serve(func(c *schedulingv1alpha3.CompositePodGroup) {
			c.Annotations = map[string]string{gangv1.AnnotationManaged: "true"}
		}), []*schedulingv1beta1.PodGroup{child("a", 1, "", nil), child("b", 2, "", nil)}, nil, []string{"a:1", "b:2"}, "", ""},
		{"no domain claim is the scheduler's", serve(nil), []*schedulingv1beta1.PodGroup{child("a", 1, "", nil), child("b", 2, "", nil)}, nil, nil, "", ""},
		{"a claim of another class is the scheduler's", serve(nil), []*schedulingv1beta1.PodGroup{child("a", 1, "shared-data", nil), child("b", 2, "", nil)}, nil, nil, "", ""},
		{"a basic policy is the scheduler's", serve(func(c *schedulingv1alpha3.CompositePodGroup) {
			c.Spec.SchedulingPolicy = schedulingv1alpha3.CompositePodGroupSchedulingPolicy{Basic: &schedulingv1alpha3.CompositeBasicSchedulingPolicy{}}
		}), both, nil, nil, "", ""},
		{"being deleted", serve(func(c *schedulingv1alpha3.CompositePodGroup) { c.DeletionTimestamp = &metav1.Time{} }), both, nil, nil, "", ""},
		{"two domain claims", serve(nil), []*schedulingv1beta1.PodGroup{child("a", 1, "fixed-domain", nil), child("b", 1, "other-domain", nil)}, nil, nil, "", "child PodGroups a and b name different domain claims (fixed-domain and other-domain)"},
		{"a child's claim missing", serve(nil), []*schedulingv1beta1.PodGroup{child("a", 1, "gone", nil), child("b", 1, "fixed-domain", nil)}, nil, nil, "", "child PodGroup a: group claim domain (gone)"},
		{"fewer children than minGroupCount", serve(nil), both[:1], nil, nil, "", "1 child PodGroups exist, the gang policy's minGroupCount is 2"},
		{"a child being deleted does not count", serve(nil), []*schedulingv1beta1.PodGroup{both[0], child("prefill", 2, "fixed-domain", func(pg *schedulingv1beta1.PodGroup) { pg.DeletionTimestamp = &metav1.Time{} })}, nil, nil, "", "1 child PodGroups exist"},
		{"a child without a gang policy", serve(nil), []*schedulingv1beta1.PodGroup{both[0], child("prefill", 2, "fixed-domain", func(pg *schedulingv1beta1.PodGroup) {
			pg.Spec.SchedulingPolicy = schedulingv1beta1.PodGroupSchedulingPolicy{Basic: &schedulingv1beta1.BasicSchedulingPolicy{}}
		})}, nil, nil, "", "child PodGroup prefill has no gang policy"},
		{"a child whose name is no role name", serve(nil), []*schedulingv1beta1.PodGroup{both[0], child("pre.fill", 2, "fixed-domain", ofTemplate("prefill"))}, nil, nil, "", "child PodGroup pre.fill: its name is its role's name, which must be a DNS label"},
		{"a child's max-size below its minCount", serve(nil), []*schedulingv1beta1.PodGroup{both[1], child("decode", 4, "fixed-domain", func(pg *schedulingv1beta1.PodGroup) {
			pg.Annotations = map[string]string{gangv1.AnnotationMaxSize: "3"}
		})}, nil, nil, "", "PodGroup decode: annotation gang.tessera.dev/max-size=\"3\""},
		{"a child of no template of the Workload", serve(nil), []*schedulingv1beta1.PodGroup{both[0], child("eval", 1, "fixed-domain", nil)}, nil, nil, "", `child PodGroup eval: its workloadRef (Workload "wl", template "eval") is not a podGroupTemplate of Workload wl's compositePodGroupTemplate serve`},
		{"a child of another Workload", serve(nil), []*schedulingv1beta1.PodGroup{both[0], child("prefill", 1, "fixed-domain", func(pg *schedulingv1beta1.PodGroup) { pg.Spec.WorkloadRef.WorkloadName = "wl2" })}, nil, nil, "", `child PodGroup prefill: its workloadRef (Workload "wl2", template "prefill")`},
		{"the Workload missing", serve(func(c *schedulingv1alpha3.CompositePodGroup) { c.Spec.WorkloadRef.WorkloadName = "gone" }), both, nil, nil, "", `its Workload gone: workload "gone" not found`},
		{"no such template in the Workload", serve(func(c *schedulingv1alpha3.CompositePodGroup) { c.Spec.WorkloadRef.TemplateName = "infer" }), both, nil, nil, "", "Workload wl has no compositePodGroupTemplate infer"},
		{"sizes past int32", serve(func(c *schedulingv1alpha3.CompositePodGroup) {
			c.Annotations = map[string]string{gangv1.AnnotationManaged: "true"}
		}), []*schedulingv1beta1.PodGroup{child("a", 1, "", func(pg *schedulingv1beta1.PodGroup) {
			pg.Annotations = map[string]string{gangv1.AnnotationMaxSize: "2147483647"}
		}), child("b", 1, "", func(pg *schedulingv1beta1.PodGroup) {
			pg.Annotations = map[string]string{gangv1.AnnotationMaxSize: "2147483647"}
		})}, nil, nil, "", "sizes add up to more than 2147483647"},
		{"nested CompositePodGroups", serve(nil), both, []string{"inner"}, nil, "", "its children include CompositePodGroups (inner)"},
		{"a nested CompositePodGroup", serve(func(c *schedulingv1alpha3.CompositePodGroup) { c.Spec.ParentCompositePodGroupName = ptr.To("outer") }), both, nil, nil, "", "it is a child of CompositePodGroup outer"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g, why := podgroups.DesiredComposite(tc.cpg, tc.children, tc.nested, look)
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
