package gang

import (
	"fmt"
	"testing"

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
