package gang

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/driver/domain"
)

// channelCondition is whether condition cond is True on the domain claim's
// channel status.
func (f *fakeCluster) channelCondition(cond string) bool {
	f.t.Helper()
	return f.channelConditionOf("domain", cond)
}

// channelConditionOf is channelCondition of domain claim ml/name.
func (f *fakeCluster) channelConditionOf(name, cond string) bool {
	f.t.Helper()
	for _, d := range f.claim("ml", name).Status.Devices {
		if apimeta.IsStatusConditionTrue(d.Conditions, cond) {
			return true
		}
	}
	return false
}

// The controller allocates the domain channel only, with binding conditions
// that keep every member in the scheduler's PreBind; it allows them to bind
// once the scheduler has allocated every member's own claims, not before.
func TestMembersBindTogetherOnceTheSchedulerAllocatedEveryMember(t *testing.T) {
	snap, nodes := trays(t, map[string]uint32{"a1": 1, "a2": 1})
	f := newFakeCluster(t, snap, nodes)
	f.gangMembers(3)
	f.reconcileOK("g")
	dc := f.claim("ml", "domain")
	if dc.Status.Allocation == nil {
		t.Fatal("the domain claim was not allocated")
	}
	for _, r := range dc.Status.Allocation.Devices.Results {
		if !strings.HasPrefix(r.Pool, domain.PoolPrefix) || len(r.BindingConditions) != 1 || r.BindingConditions[0] != domain.ConditionMembersAllocated ||
			len(r.BindingFailureConditions) != 1 || r.BindingFailureConditions[0] != domain.ConditionPlacementFailed {
			t.Fatalf("domain claim allocated %s/%s with binding conditions %v, failure %v", r.Pool, r.Device, r.BindingConditions, r.BindingFailureConditions)
		}
	}
	for _, name := range []string{"m-0", "m-1", "m-2"} {
		if c := f.claim("ml", name+"-gpu"); c.Status.Allocation != nil {
			t.Fatalf("the controller allocated member claim %s: only the scheduler may", c.Name)
		}
	}
	// The scheduler allocates two of three: the members still wait.
	f.allocateReleased("m-0", "m-1")
	f.reconcileOK("g")
	if f.channelCondition(domain.ConditionMembersAllocated) {
		t.Fatal("members allowed to bind while m-2's claim is not allocated")
	}
	f.allocateReleased("m-2")
	f.reconcileOK("g")
	if !f.channelCondition(domain.ConditionMembersAllocated) || f.channelCondition(domain.ConditionPlacementFailed) {
		t.Fatalf("every member allocated: devices status %+v, want %s True alone", f.claim("ml", "domain").Status.Devices, domain.ConditionMembersAllocated)
	}
}

// A placement that loses a member before the members bound (one the
// scheduler cannot place on its node past the grace) fails the binding of
// those waiting, so none of them starts, and evicts them.
func TestALostPlacementEndsTheWaitOfItsMembers(t *testing.T) {
	snap, nodes := trays(t, map[string]uint32{"a1": 1})
	f := newFakeCluster(t, snap, nodes)
	f.gangMembers(2)
	f.reconcileOK("g")
	f.allocateReleased("m-0")
	p := f.pod("ml", "m-1")
	p.Status.Conditions = []v1.PodCondition{{Type: v1.PodScheduled, Status: v1.ConditionFalse, Reason: v1.PodReasonUnschedulable,
		Message: "0/1 nodes are available: cannot allocate all claims", LastTransitionTime: metav1.NewTime(time.Now().Add(-2 * time.Minute))}}
	if err := f.client.Tracker().Update(v1.SchemeGroupVersion.WithResource("pods"), p, "ml"); err != nil {
		t.Fatal(err)
	}
	f.reconcileOK("g")
	if !f.channelCondition(domain.ConditionPlacementFailed) || f.channelCondition(domain.ConditionMembersAllocated) {
		t.Fatalf("devices status %+v, want %s True and the members never allowed", f.claim("ml", "domain").Status.Devices, domain.ConditionPlacementFailed)
	}
	if len(f.evicted) != 2 {
		t.Fatalf("evicted %v, want both members", f.evicted)
	}
}

// Nothing on a gang (a forged or stale record of a placement, a deleted
// gang) makes the controller clear an allocation the scheduler made: it
// clears domain channels only, which no one else allocates.
func TestNoRecordClearsAnAllocationTheSchedulerMade(t *testing.T) {
	snap, nodes := trays(t, map[string]uint32{"a1": 1})
	f := newFakeCluster(t, snap, nodes)
	f.runningPod("victim", "a1", 1, 0, func(_ *v1.Pod, c *resourceapi.ResourceClaim) {
		c.Annotations = map[string]string{gangv1.AnnotationPlacement: "forged", gangv1.AnnotationGang: "ml/g"}
	})
	f.gangMembers(1)
	g := f.gang("ml", "g")
	raw, err := json.Marshal(gangv1.UncommittedPlacement{Placement: "forged", Claims: []string{"victim-gpu"}})
	if err != nil {
		t.Fatal(err)
	}
	g.Annotations = map[string]string{gangv1.AnnotationUncommitted: string(raw)}
	if _, err := f.r.gangs.Update(f.ctx, g); err != nil {
		t.Fatal(err)
	}
	f.reconcileOK("g")
	if f.claim("ml", "victim-gpu").Status.Allocation == nil {
		t.Fatal("a record on a gang cleared another pod's claim")
	}
	if _, ok := recordOf(f.gang("ml", "g")); ok {
		t.Fatal("the record was not dropped")
	}
	// The same when the gang is deleted.
	g = f.gang("ml", "g")
	g.Annotations = map[string]string{gangv1.AnnotationUncommitted: string(raw)}
	g.DeletionTimestamp = &metav1.Time{Time: time.Now()}
	if _, err := f.r.gangs.Update(f.ctx, g); err != nil {
		t.Fatal(err)
	}
	f.reconcile("ml", "g")
	if f.claim("ml", "victim-gpu").Status.Allocation == nil {
		t.Fatal("a deleted gang's record cleared another pod's claim")
	}
}

// Every channel is tainted, so the scheduler's allocator never gives one to
// a claim; the controller's own allocation (tolerating the taint) does.
func TestOnlyTheControllerAllocatesADomainChannel(t *testing.T) {
	snap, nodes := trays(t, map[string]uint32{"a1": 1})
	claim := newClaim("domain", "domain.gpu.tessera.dev", 1)
	cluster := snap.Cluster(nil, nil)
	if res, err := cluster.AllocateOnNode(t.Context(), nodes["a1"], claim); err == nil && len(res) > 0 {
		t.Fatalf("a claim not tolerating %s got channel %s/%s", domain.TaintKey, res[0].Devices.Results[0].Pool, res[0].Devices.Results[0].Device)
	}
	res, err := cluster.AllocateOnNode(t.Context(), nodes["a1"], domain.Tolerating(claim))
	if err != nil || len(res) != 1 {
		t.Fatalf("tolerating the taint: %v, %v; want a channel", res, err)
	}
}

// A gang's spec.domainClaimName may name another gang's domain claim: the
// controller neither lets that gang's members bind (they are not all
// allocated) nor fails its placement on this gang's account. Two gangs of
// four in two cliques; g2 is placed and allocated, then pointed at g1's
// claim, and then loses a member.
func TestAGangCannotOpenOrFailAnotherGangsBarrier(t *testing.T) {
	snap, nodes := trays(t, map[string]uint32{"a1": 1, "b1": 2})
	f := newFakeCluster(t, snap, nodes)
	f.gangsOfFour("g1", "g2")
	f.reconcileOK("g1")
	f.reconcileOK("g2")
	if f.claim("ml", "g1-domain").Status.Allocation == nil || f.claim("ml", "g2-domain").Status.Allocation == nil {
		t.Fatal("both gangs should be placed, one per clique")
	}
	f.allocateReleased("g2-m0", "g2-m1", "g2-m2", "g2-m3")
	g2 := f.gang("ml", "g2")
	g2.Spec.DomainClaimName = "g1-domain"
	if _, err := f.r.gangs.Update(f.ctx, g2); err != nil {
		t.Fatal(err)
	}
	if _, err := f.reconcile("ml", "g2"); err != nil {
		t.Fatal(err)
	}
	if f.channelConditionOf("g1-domain", domain.ConditionMembersAllocated) {
		t.Errorf("g2 let g1's members bind, none of which is allocated")
	}
	// g2 loses a member: the lost path fails a binding, not g1's.
	f.deleteObject("pods", "g2-m0")
	if _, err := f.reconcile("ml", "g2"); err != nil {
		t.Fatal(err)
	}
	if f.channelConditionOf("g1-domain", domain.ConditionPlacementFailed) {
		t.Errorf("g2 failed g1's placement")
	}
	// g1's own barrier still opens once its members are allocated.
	f.allocateReleased("g1-m0", "g1-m1", "g1-m2", "g1-m3")
	f.reconcileOK("g1")
	if !f.channelConditionOf("g1-domain", domain.ConditionMembersAllocated) {
		t.Errorf("g1's members are all allocated, yet its channel does not let them bind")
	}
}
