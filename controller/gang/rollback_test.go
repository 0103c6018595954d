package gang

import (
	"encoding/json"
	"fmt"
	"slices"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/driver/domain"
)

// forgeRecord writes on gang ml/<name> a record of placement id naming
// claims, as anyone who may update gangs could (the chart's
// tessera-gang-annotations policy refuses it to all but the controller);
// edit, if set, changes the gang besides.
func (f *fakeCluster) forgeRecord(name, id string, claims []string, edit func(*gangv1.Gang)) {
	f.t.Helper()
	raw, err := json.Marshal(gangv1.UncommittedPlacement{Placement: id, Claims: claims})
	if err != nil {
		f.t.Fatal(err)
	}
	g := f.gang("ml", name)
	if g.Annotations == nil {
		g.Annotations = map[string]string{}
	}
	g.Annotations[gangv1.AnnotationUncommitted] = string(raw)
	if edit != nil {
		edit(g)
	}
	if _, err := f.r.gangs.Update(f.ctx, g); err != nil {
		f.t.Fatal(err)
	}
}

// checkHeld fails unless claim ml/<name> is still allocated and reserved
// for exactly the pods it was (want).
func (f *fakeCluster) checkHeld(name string, want []resourceapi.ResourceClaimConsumerReference) {
	f.t.Helper()
	c := f.claim("ml", name)
	if c.Status.Allocation == nil || !slices.Equal(c.Status.ReservedFor, want) {
		f.t.Errorf("claim %s: allocated %v, reserved for %v; want it still allocated, reserved for %v", name, c.Status.Allocation != nil, c.Status.ReservedFor, want)
	}
}

// A gang's record rolls back only that gang's claims: a record on gang b
// naming gang a's domain claim, with a's placement ID, leaves it allocated
// and reserved, whether b is live or deleted, even while a's own placement
// is still being written (its members gated, so that nothing but the
// claim's gang tells it apart). a's own record then rolls it back.
func TestARecordRollsBackOnlyItsOwnGangsClaims(t *testing.T) {
	for _, deleted := range []bool{false, true} {
		t.Run(map[bool]string{false: "gang b live", true: "gang b deleted"}[deleted], func(t *testing.T) {
			snap, nodes := trays(t, map[string]uint32{"a1": 1})
			f := newFakeCluster(t, snap, nodes)
			f.prioGang("a", 2, 1, 0, nil)
			f.r.interrupt = func(step string) bool { return step == StepCommit }
			if _, err := f.reconcile("ml", "a"); err != errInterrupted {
				t.Fatalf("gang a: %v, want its placement interrupted before the commit", err)
			}
			f.r.interrupt = nil
			dc := f.claim("ml", "a-domain")
			id := dc.Annotations[gangv1.AnnotationPlacement]
			if dc.Status.Allocation == nil || id == "" || len(dc.Status.ReservedFor) != 2 {
				t.Fatalf("gang a's domain claim not written by its placement: placement %q, reserved for %v", id, dc.Status.ReservedFor)
			}
			f.create(newClaim("b-domain", "domain.gpu.tessera.dev", 1))
			if _, err := f.r.gangs.Create(f.ctx, labelGangOf("b", 1, "b-domain")); err != nil {
				t.Fatal(err)
			}
			f.reconcileOK("b") // b's finalizer
			f.forgeRecord("b", id, []string{"a-domain", "a-0-gpu"}, func(g *gangv1.Gang) {
				if deleted {
					g.DeletionTimestamp = &metav1.Time{Time: time.Now()}
				}
			})
			if _, err := f.reconcile("ml", "b"); err != nil {
				t.Fatal(err)
			}
			f.checkHeld("a-domain", dc.Status.ReservedFor)
			if g, err := f.r.gangs.Get(f.ctx, "ml", "b"); err == nil {
				if _, ok := recordOf(g); ok {
					t.Error("gang b's record was not dropped")
				}
			}

			f.reconcileOK("a")
			if a := f.claim("ml", "a-domain").Status.Allocation; a != nil {
				t.Errorf("gang a's own record did not roll back its domain claim: %+v", a.Devices.Results)
			}
		})
	}
}

// No record clears a claim that serves a released member: not one on the
// claim's own gang (naming the placement the claim was written for, with the
// commit mark removed), nor one on a gang created again under the same name
// after the first was deleted with its members running.
func TestARecordNeverClearsAClaimInUse(t *testing.T) {
	for _, tc := range []struct {
		name  string
		forge func(f *fakeCluster, id string)
	}{
		{"a record on the claim's own gang", func(f *fakeCluster, id string) {
			f.forgeRecord("a", id, []string{"a-domain"}, func(g *gangv1.Gang) { delete(g.Annotations, gangv1.AnnotationCommitted) })
		}},
		{"a record on a gang created again under the same name", func(f *fakeCluster, id string) {
			g := f.gang("ml", "a")
			g.DeletionTimestamp = &metav1.Time{Time: time.Now()}
			if _, err := f.r.gangs.Update(f.ctx, g); err != nil {
				f.t.Fatal(err)
			}
			if _, err := f.reconcile("ml", "a"); err != nil {
				f.t.Fatal(err)
			}
			if a := f.claim("ml", "a-domain").Status.Allocation; a == nil {
				f.t.Fatal("deleting gang a cleared the domain claim its running members use")
			}
			if err := f.r.gangs.resource("ml").Delete(f.ctx, "a", metav1.DeleteOptions{}); err != nil {
				f.t.Fatal(err)
			}
			again := labelGangOf("a", 2, "a-domain")
			again.UID = types.UID("uid-gang-a-again")
			if _, err := f.r.gangs.Create(f.ctx, again); err != nil {
				f.t.Fatal(err)
			}
			f.forgeRecord("a", id, []string{"a-domain"}, nil)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			snap, nodes := trays(t, map[string]uint32{"a1": 1})
			f := newFakeCluster(t, snap, nodes)
			f.prioGang("a", 2, 1, 0, nil)
			id := f.reconcileOK("a").Annotations[gangv1.AnnotationCommitted]
			if id == "" {
				t.Fatal("gang a was not placed")
			}
			f.runReleased("a-0", "a-1")
			held := f.claim("ml", "a-domain").Status.ReservedFor
			tc.forge(f, id)
			if _, err := f.reconcile("ml", "a"); err != nil {
				t.Fatal(err)
			}
			f.checkHeld("a-domain", held)
			if _, ok := recordOf(f.gang("ml", "a")); ok {
				t.Error("the record was not dropped")
			}
		})
	}
}

// clearClaim, whoever calls it, clears a domain channel only once no pod
// that exists and is released (no gang gate, read from the API server) is
// among those the claim is reserved for.
func TestClearClaimLeavesAClaimAReleasedPodUses(t *testing.T) {
	for _, tc := range []struct {
		name    string
		pod     func(*v1.Pod) // nil: no pod
		cleared bool
	}{
		{"reserved for a released pod", func(p *v1.Pod) { p.Spec.SchedulingGates = nil }, false},
		{"reserved for a released pod being deleted", func(p *v1.Pod) {
			p.Spec.SchedulingGates = nil
			p.DeletionTimestamp = &metav1.Time{Time: time.Now()}
			p.Finalizers = []string{"example.com/hold"}
		}, false},
		{"reserved for a gated pod", func(*v1.Pod) {}, true},
		{"reserved for a pod that is gone", nil, true},
		{"reserved for a pod of the same name created again", func(p *v1.Pod) {
			p.Spec.SchedulingGates = nil
			p.UID = "uid-pod-m-0-again"
		}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			snap, nodes := trays(t, map[string]uint32{"a1": 1})
			f := newFakeCluster(t, snap, nodes)
			f.gangMembers(1)
			f.r.interrupt = func(step string) bool { return step == StepCommit }
			if _, err := f.reconcile("ml", "g"); err != errInterrupted {
				t.Fatalf("%v, want the placement interrupted before the commit", err)
			}
			dc := f.claim("ml", "domain")
			p := f.pod("ml", "m-0")
			if err := f.client.Tracker().Delete(v1.SchemeGroupVersion.WithResource("pods"), "ml", "m-0"); err != nil {
				t.Fatal(err)
			}
			if tc.pod != nil {
				tc.pod(p)
				f.create(p)
			}
			cleared, err := clearClaim(f.ctx, f.client, "ml", "domain", dc.Annotations[gangv1.AnnotationPlacement])
			if err != nil {
				t.Fatal(err)
			}
			if allocated := f.claim("ml", "domain").Status.Allocation != nil; cleared != tc.cleared || allocated == tc.cleared {
				t.Errorf("cleared %v, allocated after %v; want cleared %v", cleared, allocated, tc.cleared)
			}
		})
	}
}

// A gang whose spec.domainClaimName names another gang's domain claim,
// allocated for a placement whose members are not released yet (the
// controller cut before the release), does not roll that channel back.
func TestAGangDoesNotRollBackAnotherGangsDomainClaim(t *testing.T) {
	snap, nodes := trays(t, map[string]uint32{"a1": 1})
	f := newFakeCluster(t, snap, nodes)
	f.gangsOfFour("g1")
	f.r.interrupt = func(step string) bool { return step == StepRelease }
	if _, err := f.reconcile("ml", "g1"); err == nil {
		t.Fatal("the placement was not cut at the release")
	}
	f.r.interrupt = nil
	if f.claim("ml", "g1-domain").Status.Allocation == nil {
		t.Fatal("g1's domain claim is not allocated")
	}
	other := &gangv1.Gang{ObjectMeta: metav1.ObjectMeta{Name: "other", Namespace: "ml", UID: "uid-other"},
		Spec: gangv1.GangSpec{Size: 1, DomainClaimName: "g1-domain", Selector: metav1.LabelSelector{MatchLabels: map[string]string{"gang": "nobody"}}}}
	if _, err := f.r.gangs.Create(f.ctx, other); err != nil {
		t.Fatal(err)
	}
	if _, err := f.reconcile("ml", "other"); err != nil {
		t.Fatal(err)
	}
	if f.claim("ml", "g1-domain").Status.Allocation == nil {
		t.Fatalf("gang other cleared g1's domain claim; events %v", f.drainEvents())
	}
	// g1 goes on: its members are released onto its channel.
	f.reconcileOK("g1")
	if f.claim("ml", "g1-domain").Status.Allocation == nil || len(f.pod("ml", "g1-m0").Spec.SchedulingGates) != 0 {
		t.Errorf("g1 did not go on in its placement")
	}
}

// A gang deleted between its members' release and their bind fails their
// binding and evicts them: no one else would open or fail the barrier they
// wait at, and their pins would keep every other gang off their devices.
// Another gang is then placed on that tray.
func TestAGangDeletedBeforeItsMembersBoundLetsThemGo(t *testing.T) {
	snap, nodes := trays(t, map[string]uint32{"a1": 1})
	f := newFakeCluster(t, snap, nodes)
	f.gangsOfFour("g1", "g2")
	f.reconcileOK("g1")
	g := f.gang("ml", "g1")
	g.DeletionTimestamp = &metav1.Time{Time: time.Now()}
	if _, err := f.r.gangs.Update(f.ctx, g); err != nil {
		t.Fatal(err)
	}
	if _, err := f.reconcile("ml", "g1"); err != nil {
		t.Fatal(err)
	}
	if !f.channelConditionOf("g1-domain", domain.ConditionPlacementFailed) {
		t.Errorf("g1's members wait to bind at a barrier no one will open or fail")
	}
	for i := range 4 {
		if _, err := f.client.CoreV1().Pods("ml").Get(f.ctx, fmt.Sprintf("g1-m%d", i), metav1.GetOptions{}); err == nil {
			t.Errorf("released, unbound member g1-m%d of the deleted gang was not evicted", i)
		}
	}
	f.freeClaimsOfGonePods()
	f.reconcileOK("g2")
	if f.gang("ml", "g2").Annotations[gangv1.AnnotationCommitted] == "" {
		t.Errorf("g2 is not placed on the tray the deleted gang's members left")
	}
}
