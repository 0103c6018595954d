package gang

import (
	"fmt"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
)

// gangsOfFour creates label gangs ml/<name> of four one-GPU members
// <name>-m<i>, each with its own domain claim <name>-domain.
func (f *fakeCluster) gangsOfFour(names ...string) {
	f.t.Helper()
	for _, g := range names {
		f.create(newClaim(g+"-domain", "domain.gpu.tessera.dev", 1))
		for i := range 4 {
			f.memberOf(fmt.Sprintf("%s-m%d", g, i), g+"-domain", map[string]string{"gang": g}, 1, nil)
		}
		if _, err := f.r.gangs.Create(f.ctx, labelGangOf(g, 4, g+"-domain")); err != nil {
			f.t.Fatal(err)
		}
	}
}

// A gang released onto a tray holds that tray for the scheduler to
// allocate, though no claim of it is allocated yet: a second gang searched
// in that window is not planned onto the same GPUs (both would wait in the
// scheduler for devices only one can get, fail and be placed again the same
// way). The second waits, and goes on waiting once the scheduler has
// allocated the first's members.
func TestASecondGangIsNotPlannedOntoAFirstGangsReleasedMembers(t *testing.T) {
	snap, nodes := trays(t, map[string]uint32{"a1": 1})
	f := newFakeCluster(t, snap, nodes)
	f.gangsOfFour("g1", "g2")
	f.reconcileOK("g1")
	for i := range 4 {
		if p := f.pod("ml", fmt.Sprintf("g1-m%d", i)); pinnedTo(p) != "a1" {
			t.Fatalf("g1-m%d pinned to %q, want a1", i, pinnedTo(p))
		}
	}
	// g1's members are released; the scheduler has allocated none yet.
	f.reconcileOK("g2")
	for i := range 4 {
		if p := f.pod("ml", fmt.Sprintf("g2-m%d", i)); len(p.Spec.SchedulingGates) == 0 || pinnedTo(p) != "" {
			t.Errorf("g2-m%d released (pinned to %q) onto the tray g1 was released onto", i, pinnedTo(p))
		}
	}
	if id := f.gang("ml", "g2").Annotations[gangv1.AnnotationCommitted]; id != "" {
		t.Errorf("g2 committed placement %s on the GPUs promised to g1", id)
	}
	// The scheduler allocates g1's members: the tray stays full for g2.
	f.allocateReleased("g1-m0", "g1-m1", "g1-m2", "g1-m3")
	f.reconcileOK("g2")
	if id := f.gang("ml", "g2").Annotations[gangv1.AnnotationCommitted]; id != "" {
		t.Errorf("g2 committed placement %s on g1's allocated GPUs", id)
	}
}

// A released member whose claim the allocator cannot judge (a selector
// that errors on some device) takes nothing in another gang's search, and
// that search goes on: g2 is placed in the other clique.
func TestAPinTheAllocatorFailsOnDoesNotStopAnotherGangsSearch(t *testing.T) {
	snap, nodes := trays(t, map[string]uint32{"a1": 1, "b1": 2})
	f := newFakeCluster(t, snap, nodes)
	f.create(newClaim("g1-domain", "domain.gpu.tessera.dev", 1))
	f.memberOf("g1-m0", "g1-domain", map[string]string{"gang": "g1"}, 1, nil)
	c := f.claim("ml", "g1-m0-gpu")
	c.Spec.Devices.Requests[0].Exactly.Selectors = []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{
		Expression: `device.attributes["gpu.tessera.dev"].index == 0 || device.attributes["gpu.tessera.dev"].nope == 1`}}}
	if _, err := f.client.ResourceV1().ResourceClaims("ml").Update(f.ctx, c, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := f.r.gangs.Create(f.ctx, labelGangOf("g1", 1, "g1-domain")); err != nil {
		t.Fatal(err)
	}
	f.reconcileOK("g1")
	// The scheduler gives gpu-0 of that node to another pod first.
	f.runningPod("rival", pinnedTo(f.pod("ml", "g1-m0")), 1, 0)
	f.gangsOfFour("g2")
	_, err := f.reconcile("ml", "g2")
	if g2 := f.gang("ml", "g2"); err != nil || g2.Annotations[gangv1.AnnotationCommitted] == "" {
		t.Errorf("g2 not placed: %v; %s", err, conditionMessage(&g2.Status, gangv1.ConditionWaiting))
	}
}
