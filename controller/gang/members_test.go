package gang

import (
	"fmt"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
)

// podGroupMember is a pod of PodGroup "train" whose claim "domain" resolved
// to the group's claim and whose claim "gpus" to gpusClaim.
func podGroupMember(name, gpusClaim string) *v1.Pod {
	return &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ml", UID: types.UID("uid-" + name)},
		Spec: v1.PodSpec{
			SchedulingGroup: &v1.PodSchedulingGroup{PodGroupName: ptr.To("train")},
			ResourceClaims: []v1.PodResourceClaim{
				{Name: "gpus", ResourceClaimTemplateName: ptr.To("gpus")},
				{Name: "domain", ResourceClaimTemplateName: ptr.To("domain")},
			},
		},
		Status: v1.PodStatus{ResourceClaimStatuses: []v1.PodResourceClaimStatus{
			{Name: "gpus", ResourceClaimName: ptr.To(gpusClaim)},
			{Name: "domain", ResourceClaimName: ptr.To("train-domain-abcde")},
		}},
	}
}

func TestAPodGroupsClaimIsTheGangsSharedDomainClaim(t *testing.T) {
	a, b := podGroupMember("a", "a-gpus"), podGroupMember("b", "b-gpus")
	other := podGroupMember("c", "c-gpus")
	other.Spec.SchedulingGroup.PodGroupName = ptr.To("eval")
	claims := map[string]*resourceapi.ResourceClaim{"train-domain-abcde": {ObjectMeta: metav1.ObjectMeta{Name: "train-domain-abcde"},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
			Name: "domain", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: gangv1.DomainClass}}}}}}}
	for _, p := range []*v1.Pod{a, b, other} {
		name := *p.Status.ResourceClaimStatuses[0].ResourceClaimName
		claims[name] = &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: name, OwnerReferences: []metav1.OwnerReference{{
			APIVersion: "v1", Kind: "Pod", Name: p.Name, UID: p.UID, Controller: ptr.To(true),
		}}}}
	}
	get := func(_, name string) (*resourceapi.ResourceClaim, error) {
		if c := claims[name]; c != nil {
			return c, nil
		}
		return nil, fmt.Errorf("no claim %s", name)
	}
	g := &gangv1.Gang{ObjectMeta: metav1.ObjectMeta{Name: "train", Namespace: "ml"}, Spec: gangv1.GangSpec{Size: 2, PodGroupName: "train", DomainClaimName: "train-domain-abcde"}}
	members, err := gangv1.Validate(g)
	if err != nil {
		t.Fatal(err)
	}
	v := observe(g, members, []*v1.Pod{a, other, b}, get)
	if v.invalid != "" || v.pending != "" || v.domainClaim == nil || len(v.live) != 2 {
		t.Fatalf("view: invalid %q, pending %q, domain claim %v, %d live; want both members of train, nothing wrong", v.invalid, v.pending, v.domainClaim, len(v.live))
	}
	for _, m := range v.live {
		if len(m.claims) != 1 || m.claims[0].Name != m.pod.Name+"-gpus" {
			t.Errorf("member %s: own claims %v, want only %s-gpus (the group's claim is the domain claim)", m.pod.Name, m.claims, m.pod.Name)
		}
	}

	// A member using a claim that is not its own (here b's) cannot be placed:
	// the controller would allocate one claim for two pods.
	a.Status.ResourceClaimStatuses[0].ResourceClaimName = ptr.To("b-gpus")
	v = observe(g, members, []*v1.Pod{a, b}, get)
	if !strings.Contains(v.invalid, "ml/a uses claim b-gpus, which is not its own") {
		t.Errorf("invalid %q, want member a's foreign claim named", v.invalid)
	}
}

func TestAReleasedMemberUnschedulablePastTheGraceIsLost(t *testing.T) {
	now := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	r := &reconciler{unschedulableGrace: time.Minute}
	pending := func(name string, since time.Duration, reason string) *member {
		return &member{pod: &v1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			Status: v1.PodStatus{Conditions: []v1.PodCondition{{
				Type: v1.PodScheduled, Status: v1.ConditionFalse, Reason: reason,
				Message: "0/5 nodes are available: 1 Insufficient cpu", LastTransitionTime: metav1.NewTime(now.Add(-since)),
			}}},
		}}
	}
	bound := pending("bound", time.Hour, v1.PodReasonUnschedulable)
	bound.pod.Spec.NodeName = "tray-a1"
	gated := pending("gated", time.Hour, v1.PodReasonUnschedulable)
	gated.pod.Spec.SchedulingGates = []v1.PodSchedulingGate{{Name: gangv1.SchedulingGate}}

	lost, _, recheck := r.stuck([]*member{bound, gated, pending("recent", 20*time.Second, v1.PodReasonUnschedulable), pending("other", time.Hour, "SchedulerError")}, now)
	if len(lost) != 0 || recheck != 40*time.Second {
		t.Errorf("lost %v, recheck in %v; want none lost yet, a look again in 40s", lost, recheck)
	}
	lost, _, _ = r.stuck([]*member{pending("old", 61*time.Second, v1.PodReasonUnschedulable)}, now)
	if len(lost) != 1 || !strings.Contains(lost[0], "member old cannot be scheduled on the node it was placed on: 0/5 nodes are available: 1 Insufficient cpu") {
		t.Errorf("lost %v, want member old named with the scheduler's reason", lost)
	}
}

// A claim named as the gang's domain claim that asks for a GPU is not a
// domain claim: the gang is invalid, naming the request and the fix, and
// the controller writes nothing to it (only the scheduler allocates GPUs;
// a GPU written beside it would be held twice).
func TestADomainClaimThatAsksForAGPUMakesTheGangInvalid(t *testing.T) {
	snap, nodes := trays(t, map[string]uint32{"a1": 1})
	f := newFakeCluster(t, snap, nodes)
	f.create(newClaim("domain", "gpu.tessera.dev", 1))
	f.member("m-0", map[string]string{"gang": "g"}, 1)
	if _, err := f.r.gangs.Create(f.ctx, labelGangOf("g", 1, "domain")); err != nil {
		t.Fatal(err)
	}
	if _, err := f.reconcile("ml", "g"); err != nil {
		t.Fatal(err)
	}
	if a := f.claim("ml", "domain").Status.Allocation; a != nil {
		t.Errorf("the controller allocated the claim of class gpu.tessera.dev: %+v", a.Devices.Results)
	}
	c := meta.FindStatusCondition(f.gang("ml", "g").Status.Conditions, gangv1.ConditionWaiting)
	if c == nil || c.Reason != gangv1.ReasonInvalid || !strings.Contains(c.Message, "spec.devices.requests[0]") || !strings.Contains(c.Message, "class gpu.tessera.dev") {
		t.Errorf("Waiting condition %+v, want InvalidGang naming the request and its class", c)
	}
	if p := f.pod("ml", "m-0"); len(p.Spec.SchedulingGates) == 0 {
		t.Errorf("member m-0 released for an invalid gang")
	}
}
