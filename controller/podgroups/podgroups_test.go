package podgroups_test

import (
	"fmt"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	schedulingv1beta1 "k8s.io/api/scheduling/v1beta1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/controller/podgroups"
)

func claimOf(name, class string) *resourceapi.ResourceClaim {
	return &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ml"},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
			Name: "r", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: class},
		}}}},
	}
}

var claims = map[string]*resourceapi.ResourceClaim{
	"train-domain-abcde": claimOf("train-domain-abcde", gangv1.DomainClass),
	"fixed-domain":       claimOf("fixed-domain", gangv1.DomainClass),
	"other-domain":       claimOf("other-domain", gangv1.DomainClass),
	"shared-data":        claimOf("shared-data", "data.example.com"),
}

func getClaim(_, name string) (*resourceapi.ResourceClaim, error) {
	if c := claims[name]; c != nil {
		return c, nil
	}
	return nil, fmt.Errorf("resourceclaim %q not found", name)
}

func group(mut func(*schedulingv1beta1.PodGroup)) *schedulingv1beta1.PodGroup {
	pg := &schedulingv1beta1.PodGroup{
		ObjectMeta: metav1.ObjectMeta{Name: "train", Namespace: "ml", UID: "pg-1"},
		Spec: schedulingv1beta1.PodGroupSpec{
			SchedulingPolicy: schedulingv1beta1.PodGroupSchedulingPolicy{Gang: &schedulingv1beta1.GangSchedulingPolicy{MinCount: 4}},
			ResourceClaims:   []schedulingv1beta1.PodGroupResourceClaim{{Name: "domain", ResourceClaimTemplateName: ptr.To("domain-tmpl")}},
		},
		Status: schedulingv1beta1.PodGroupStatus{ResourceClaimStatuses: []schedulingv1beta1.PodGroupResourceClaimStatus{{Name: "domain", ResourceClaimName: ptr.To("train-domain-abcde")}}},
	}
	if mut != nil {
		mut(pg)
	}
	return pg
}

func TestDesiredGangOfAPodGroup(t *testing.T) {
	for _, tc := range []struct {
		name string
		pg   *schedulingv1beta1.PodGroup
		// domain is the gang's domain claim; "-" for no gang.
		domain string
		// why is a part of the reason there is no gang yet; "" for none.
		why string
	}{
		{"a template group claim of the domain class", group(nil), "train-domain-abcde", ""},
		{"a named group claim of the domain class", group(func(pg *schedulingv1beta1.PodGroup) {
			pg.Spec.ResourceClaims = []schedulingv1beta1.PodGroupResourceClaim{{Name: "domain", ResourceClaimName: ptr.To("fixed-domain")}}
			pg.Status.ResourceClaimStatuses = nil
		}), "fixed-domain", ""},
		{"the group claim not made yet", group(func(pg *schedulingv1beta1.PodGroup) { pg.Status.ResourceClaimStatuses = nil }), "-", "group claim domain"},
		{"a named group claim missing", group(func(pg *schedulingv1beta1.PodGroup) {
			pg.Spec.ResourceClaims = []schedulingv1beta1.PodGroupResourceClaim{{Name: "domain", ResourceClaimName: ptr.To("gone")}}
		}), "-", "not found"},
		{"a basic policy is the scheduler's", group(func(pg *schedulingv1beta1.PodGroup) {
			pg.Spec.SchedulingPolicy = schedulingv1beta1.PodGroupSchedulingPolicy{Basic: &schedulingv1beta1.BasicSchedulingPolicy{}}
		}), "-", ""},
		{"a group claim of another class is not ours", group(func(pg *schedulingv1beta1.PodGroup) {
			pg.Spec.ResourceClaims = []schedulingv1beta1.PodGroupResourceClaim{{Name: "data", ResourceClaimName: ptr.To("shared-data")}}
		}), "-", ""},
		{"annotated managed without a domain claim", group(func(pg *schedulingv1beta1.PodGroup) {
			pg.Spec.ResourceClaims, pg.Status.ResourceClaimStatuses = nil, nil
			pg.Annotations = map[string]string{gangv1.AnnotationManaged: "true"}
		}), "", ""},
		{"two domain claims", group(func(pg *schedulingv1beta1.PodGroup) {
			pg.Spec.ResourceClaims = append(pg.Spec.ResourceClaims, schedulingv1beta1.PodGroupResourceClaim{Name: "second", ResourceClaimName: ptr.To("other-domain")})
		}), "-", "both domain claims"},
		{"being deleted", group(func(pg *schedulingv1beta1.PodGroup) { pg.DeletionTimestamp = &metav1.Time{} }), "-", ""},
		{"elastic", group(func(pg *schedulingv1beta1.PodGroup) {
			pg.Annotations = map[string]string{gangv1.AnnotationMaxSize: "8"}
		}), "train-domain-abcde", ""},
		{"elastic below minCount", group(func(pg *schedulingv1beta1.PodGroup) {
			pg.Annotations = map[string]string{gangv1.AnnotationMaxSize: "3"}
		}), "-", `annotation gang.tessera.dev/max-size="3": want a number of at least the gang policy's minCount (4)`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g, why := podgroups.Desired(tc.pg, getClaim)
			if !strings.Contains(why, tc.why) || (tc.why == "") != (why == "") {
				t.Errorf("reason %q, want one with %q", why, tc.why)
			}
			if tc.domain == "-" {
				if g != nil {
					t.Fatalf("gang %+v, want none", g.Spec)
				}
				return
			}
			if g == nil {
				t.Fatalf("no gang (%s)", why)
			}
			least, most := gangv1.Bounds(&g.Spec)
			wantMost := int32(4)
			if tc.pg.Annotations[gangv1.AnnotationMaxSize] == "8" {
				wantMost = 8
			}
			if g.Name != "train" || g.Namespace != "ml" || least != 4 || most != wantMost || g.Spec.PodGroupName != "train" || g.Spec.DomainClaimName != tc.domain {
				t.Errorf("gang %s/%s %+v, want ml/train of 4 to %d members of PodGroup train, domain claim %q", g.Namespace, g.Name, g.Spec, wantMost, tc.domain)
			}
			if !metav1.IsControlledBy(g, tc.pg) {
				t.Errorf("gang owners %+v, want the PodGroup as controller", g.OwnerReferences)
			}
			members, err := gangv1.Validate(g)
			if err != nil {
				t.Fatal(err)
			}
			in := &corev1.Pod{Spec: corev1.PodSpec{SchedulingGroup: &corev1.PodSchedulingGroup{PodGroupName: ptr.To("train")}}}
			out := &corev1.Pod{Spec: corev1.PodSpec{SchedulingGroup: &corev1.PodSchedulingGroup{PodGroupName: ptr.To("eval")}}}
			if !members.Matches(in) || members.Matches(out) || members.Matches(&corev1.Pod{}) {
				t.Errorf("members: pod of train %v, of eval %v, of none %v; want only train's", members.Matches(in), members.Matches(out), members.Matches(&corev1.Pod{}))
			}
		})
	}
}

func TestAGangNamesItsMembersOneWay(t *testing.T) {
	g := &gangv1.Gang{ObjectMeta: metav1.ObjectMeta{Name: "g", Namespace: "ml"}, Spec: gangv1.GangSpec{
		Size: 2, PodGroupName: "train", Selector: metav1.LabelSelector{MatchLabels: map[string]string{"job": "train"}},
	}}
	if _, err := gangv1.Validate(g); err == nil || !strings.Contains(err.Error(), "spec.selector and spec.podGroupName") {
		t.Errorf("both set: %v, want an error naming both fields", err)
	}
	g.Spec.PodGroupName = ""
	members, err := gangv1.Validate(g)
	if err != nil {
		t.Fatal(err)
	}
	if !members.Matches(&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"job": "train"}}}) || members.Matches(&corev1.Pod{}) {
		t.Error("a selector gang does not pick exactly its labelled pods")
	}
	g.Spec.Selector = metav1.LabelSelector{}
	if _, err := gangv1.Validate(g); err == nil || !strings.Contains(err.Error(), "spec.podGroupName") {
		t.Errorf("neither set: %v, want an error pointing at both ways", err)
	}
}
