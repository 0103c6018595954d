package gang

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
)

// elasticGang creates gang ml/g of members m-0..m-<n-1> (one GPU each, no
// completion index: ranked by name) with minSize least and maxSize most,
// sharing domain claim "domain".
func (f *fakeCluster) elasticGang(n int, least, most int32) {
	f.t.Helper()
	f.gangMembers(n, func(g *gangv1.Gang) {
		g.Spec.Size, g.Spec.MinSize, g.Spec.MaxSize = 0, least, most
	})
}

// setPhase sets a pod's phase, as its kubelet would.
func (f *fakeCluster) setPhase(name string, phase v1.PodPhase) {
	f.t.Helper()
	p := f.pod("ml", name)
	p.Status.Phase = phase
	if err := f.client.Tracker().Update(v1.SchemeGroupVersion.WithResource("pods"), p, "ml"); err != nil {
		f.t.Fatal(err)
	}
}

// deleteObject removes a pod or claim from the clientset.
func (f *fakeCluster) deleteObject(resource, name string) {
	f.t.Helper()
	gvr := v1.SchemeGroupVersion.WithResource(resource)
	if resource == "resourceclaims" {
		gvr.Group, gvr.Version = "resource.k8s.io", "v1"
	}
	if err := f.client.Tracker().Delete(gvr, "ml", name); err != nil {
		f.t.Fatal(err)
	}
}

// released says which of the pods are released (ungated), and the rank each
// was released with.
func (f *fakeCluster) released(names ...string) map[string]string {
	f.t.Helper()
	out := map[string]string{}
	for _, name := range names {
		if p := f.pod("ml", name); !hasGate(p) {
			out[name] = p.Annotations[gangv1.AnnotationRank]
		}
	}
	return out
}

// An elastic gang starts with the members that fit (at least its minimum),
// grows into its domain when room appears there, lets a failed member go
// without touching the others, gives the failed member's rank to its
// replacement (here ranked last by name: the rank is kept, not recomputed),
// and is placed again only once fewer than its minimum live.
func TestAnElasticGangStartsAtItsMinimumGrowsAndGoesOnWithoutALostMember(t *testing.T) {
	snap, nodes := trays(t, map[string]uint32{"b1": 2, "b2": 2})
	f := newFakeCluster(t, snap, nodes)
	f.runningPod("blocker", "b2", 4, 0)
	f.elasticGang(6, 3, 6)
	all := []string{"m-0", "m-1", "m-2", "m-3", "m-4", "m-5"}

	g := f.reconcileOK("g")
	id := g.Annotations[gangv1.AnnotationCommitted]
	if id == "" || !strings.HasPrefix(g.Status.Domain, poolOf(2)) {
		t.Fatalf("not placed in clique 2: %q %+v", g.Status.Domain, g.Status.Conditions)
	}
	if got, want := f.released(all...), map[string]string{"m-0": "0", "m-1": "1", "m-2": "2", "m-3": "3"}; !sameMap(got, want) {
		t.Fatalf("released %v, want the four that fit beside the blocker, ranks 0-3: %v", got, want)
	}
	for _, name := range []string{"m-4", "m-5"} {
		if c := f.claim("ml", name+"-gpu"); c.Status.Allocation != nil {
			t.Fatalf("member %s left waiting has an allocated claim", name)
		}
	}
	if ev := strings.Join(f.drainEvents(), "\n"); !strings.Contains(ev, "placed 4 members in "+poolOf(2)) || !strings.Contains(ev, "2 more join when room appears there") {
		t.Errorf("events:\n%s", ev)
	}
	f.runReleased("m-0", "m-1", "m-2", "m-3")
	if g = f.reconcileOK("g"); g.Annotations[gangv1.AnnotationCommitted] != id || len(f.evicted) != 0 {
		t.Fatalf("a look with no room changed the placement: %q, evicted %v", g.Annotations[gangv1.AnnotationCommitted], f.evicted)
	}

	// Room appears in the domain: the two waiting members join the
	// placement, under its ID, on the freed tray.
	f.deleteObject("pods", "blocker")
	f.deleteObject("resourceclaims", "blocker-gpu")
	g = f.reconcileOK("g")
	if got := f.released("m-4", "m-5"); !sameMap(got, map[string]string{"m-4": "4", "m-5": "5"}) {
		t.Fatalf("after room appeared: released %v, want m-4 and m-5 with ranks 4 and 5", got)
	}
	for _, name := range []string{"m-4", "m-5"} {
		p, c := f.pod("ml", name), f.claim("ml", name+"-gpu")
		if pinnedTo(p) != "b2" || p.Annotations[gangv1.AnnotationPlacement] != id || c.Annotations[gangv1.AnnotationPlacement] != id || c.Annotations[gangv1.AnnotationSize] != "6" || c.Status.Allocation == nil {
			t.Errorf("grown member %s: pinned to %q, placement %q/%q, size %q, allocated %v", name, pinnedTo(p), p.Annotations[gangv1.AnnotationPlacement], c.Annotations[gangv1.AnnotationPlacement], c.Annotations[gangv1.AnnotationSize], c.Status.Allocation != nil)
		}
	}
	if _, ok := g.Annotations[gangv1.AnnotationUncommitted]; ok || g.Annotations[gangv1.AnnotationCommitted] != id {
		t.Fatalf("after growing: annotations %v", g.Annotations)
	}
	if ev := strings.Join(f.drainEvents(), "\n"); !strings.Contains(ev, gangv1.ReasonGrown+" added 2 members to the placement in "+poolOf(2)+"; it has 6 of at most 6") {
		t.Errorf("events:\n%s", ev)
	}
	f.runReleased("m-4", "m-5")

	// A member fails: the others go on, nothing is evicted.
	f.setPhase("m-1", v1.PodFailed)
	g = f.reconcileOK("g")
	failed := meta.FindStatusCondition(g.Status.Conditions, gangv1.ConditionFailed)
	if len(f.evicted) != 0 || g.Annotations[gangv1.AnnotationCommitted] != id || failed == nil || failed.Status != metav1.ConditionFalse || failed.Reason != gangv1.ReasonShrunk ||
		!strings.Contains(failed.Message, "member m-1 failed; the placement lost 1 members since the last look; the gang goes on with 5 of at most 6 members (at least 3)") {
		t.Fatalf("after a member failed: evicted %v, committed %q, Failed %+v", f.evicted, g.Annotations[gangv1.AnnotationCommitted], failed)
	}

	// Its replacement (named last) takes its rank, in the same domain,
	// once the failed member's claim is freed.
	f.deleteObject("resourceclaims", "m-1-gpu")
	f.member("m-9", map[string]string{"gang": "g"}, 1)
	g = f.reconcileOK("g")
	if got := f.released("m-9"); got["m-9"] != "1" {
		t.Fatalf("replacement released %v, want rank 1 (the failed member's)", got)
	}
	if p := f.pod("ml", "m-9"); pinnedTo(p) != "b1" || p.Annotations[gangv1.AnnotationPlacement] != id {
		t.Fatalf("replacement pinned to %q in placement %q, want b1 in %q", pinnedTo(p), p.Annotations[gangv1.AnnotationPlacement], id)
	}
	f.runReleased("m-9")

	// A member simply gone (its pod deleted, no trace left) is noticed
	// from the placement's count, and the gang goes on.
	f.deleteObject("pods", "m-5")
	g = f.reconcileOK("g")
	failed = meta.FindStatusCondition(g.Status.Conditions, gangv1.ConditionFailed)
	if len(f.evicted) != 0 || g.Annotations[gangv1.AnnotationCommitted] != id || g.Status.PlacedMembers != 5 || failed == nil || failed.Reason != gangv1.ReasonShrunk ||
		!strings.Contains(failed.Message, "the placement lost 1 members since the last look; the gang goes on with 5 of at most 6") {
		t.Fatalf("after a member vanished: evicted %v, placed members %d, Failed %+v", f.evicted, g.Status.PlacedMembers, failed)
	}
	// The next look still says it shrank (it holds fewer than its most).
	if g = f.reconcileOK("g"); conditionReasonOf(g, gangv1.ConditionFailed) != gangv1.ReasonShrunk {
		t.Fatalf("the shrink was forgotten on the next look: %+v", g.Status.Conditions)
	}

	// Below the minimum, the gang is placed again as a fixed one would be:
	// the rest are evicted.
	for _, name := range []string{"m-0", "m-2", "m-3", "m-4"} {
		f.setPhase(name, v1.PodFailed)
	}
	g = f.reconcileOK("g")
	slices.Sort(f.evicted)
	if want := []string{"m-9"}; !slices.Equal(f.evicted, want) || g.Annotations[gangv1.AnnotationCommitted] != "" {
		t.Fatalf("below the minimum: evicted %v (want %v), committed %q", f.evicted, want, g.Annotations[gangv1.AnnotationCommitted])
	}
}

func conditionReasonOf(g *gangv1.Gang, typ string) string {
	if c := meta.FindStatusCondition(g.Status.Conditions, typ); c != nil {
		return c.Reason
	}
	return ""
}

func sameMap(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}

// A growth cut short after writing a claim is rolled back from its record:
// only the new member's claims are cleared, the placement stays committed
// and its running members untouched, and the next look grows again.
func TestAnInterruptedGrowthIsRolledBackAloneAndRetried(t *testing.T) {
	snap, nodes := trays(t, map[string]uint32{"b1": 2, "b2": 2})
	f := newFakeCluster(t, snap, nodes)
	f.runningPod("blocker", "b2", 4, 0)
	f.elasticGang(6, 2, 6)
	id := f.reconcileOK("g").Annotations[gangv1.AnnotationCommitted]
	f.runReleased("m-0", "m-1", "m-2", "m-3")
	f.deleteObject("pods", "blocker")
	f.deleteObject("resourceclaims", "blocker-gpu")

	f.r.interrupt = func(step string) bool { return step == StepClaimWritten }
	if _, err := f.reconcile("ml", "g"); err == nil || !strings.Contains(err.Error(), errInterrupted.Error()) {
		t.Fatalf("growth: %v, want it interrupted", err)
	}
	f.r.interrupt = nil
	g := f.gang("ml", "g")
	rec, ok := recordOf(g)
	if !ok || !rec.Growth || rec.Placement != id || len(rec.Claims) != 2 {
		t.Fatalf("record of the cut growth: %+v (present %v), want a growth of %s with two claims", rec, ok, id)
	}
	written := 0
	for _, name := range []string{"m-4", "m-5"} {
		if f.claim("ml", name+"-gpu").Status.Allocation != nil {
			written++
		}
	}
	if written == 0 {
		t.Fatal("no claim written before the cut: the test does not exercise a cut growth")
	}

	g = f.reconcileOK("g")
	if _, ok := recordOf(g); ok || g.Annotations[gangv1.AnnotationCommitted] != id {
		t.Fatalf("after the rollback: annotations %v", g.Annotations)
	}
	for _, name := range []string{"m-4", "m-5"} {
		if c := f.claim("ml", name+"-gpu"); c.Status.Allocation != nil || !hasGate(f.pod("ml", name)) {
			t.Errorf("member %s: claim still allocated or released after the rollback", name)
		}
	}
	for _, name := range []string{"m-0", "m-1", "m-2", "m-3"} {
		if c := f.claim("ml", name+"-gpu"); c.Status.Allocation == nil || f.pod("ml", name).Status.Phase != v1.PodRunning {
			t.Errorf("running member %s touched by the growth's rollback", name)
		}
	}
	if len(f.evicted) != 0 {
		t.Fatalf("evicted %v", f.evicted)
	}
	f.reconcileOK("g")
	if got := f.released("m-4", "m-5"); len(got) != 2 {
		t.Fatalf("the next look did not grow the gang: released %v", got)
	}
}

// A gang that preempts an elastic one takes only the members above its
// minimums, the last role's highest ranks first: the launcher and the
// workers' minimum keep running and the elastic gang goes on.
func TestAPreemptingGangTakesOnlyTheWorkersAboveAnElasticGangsMinimum(t *testing.T) {
	snap, nodes := trays(t, map[string]uint32{"a1": 1, "b1": 2, "b2": 2})
	f := newFakeCluster(t, snap, nodes)
	f.create(newClaim("domain", "domain.gpu.tessera.dev", 1))
	f.memberOf("launcher", "domain", map[string]string{"gang": "g", "role": "launcher"}, 1, func(p *v1.Pod) { p.Spec.Priority = ptr.To[int32](100) })
	for i := range 3 {
		f.memberOf(fmt.Sprintf("w-%d", i), "domain", map[string]string{"gang": "g", "role": "worker"}, 1, func(p *v1.Pod) { p.Spec.Priority = ptr.To[int32](100) })
	}
	g := labelGangOf("g", 4, "domain")
	g.Spec.Roles = []gangv1.Role{
		{Name: "launcher", Size: 1, Selector: metav1.LabelSelector{MatchLabels: map[string]string{"role": "launcher"}}},
		{Name: "workers", Size: 3, MinSize: 1, Selector: metav1.LabelSelector{MatchLabels: map[string]string{"role": "worker"}}},
	}
	if _, err := f.r.gangs.Create(f.ctx, g); err != nil {
		t.Fatal(err)
	}
	if g := f.reconcileOK("g"); !strings.HasPrefix(g.Status.Domain, poolOf(1)) {
		t.Fatalf("elastic gang not placed in clique 1: %q", g.Status.Domain)
	}
	f.runReleased("launcher", "w-0", "w-1", "w-2")
	f.runningPod("mid-b1", "b1", 4, 500)
	f.runningPod("mid-b2", "b2", 4, 500)

	f.prioGang("high", 2, 1, 1000, nil)
	high := f.reconcileOK("high")
	if want := []string{"w-2", "w-1"}; !slices.Equal(f.evicted, want) {
		t.Fatalf("evicted %v, want the two workers above the minimum, highest rank first: %v", f.evicted, want)
	}
	if pre := high.Status.Preemption; pre == nil || pre.Domain != poolOf(1) || !slices.Equal(pre.Victims, []string{"ml/w-1", "ml/w-2"}) {
		t.Fatalf("preemption %+v", pre)
	}
	g = f.reconcileOK("g")
	if g.Annotations[gangv1.AnnotationCommitted] == "" || len(f.evicted) != 2 {
		t.Fatalf("the elastic gang was not left to go on: committed %q, evicted %v", g.Annotations[gangv1.AnnotationCommitted], f.evicted)
	}
	for _, name := range []string{"launcher", "w-0"} {
		if p := f.pod("ml", name); p.Status.Phase != v1.PodRunning {
			t.Errorf("%s: %s", name, p.Status.Phase)
		}
	}
	f.freeClaimsOfGonePods()
	if high = f.reconcileOK("high"); high.Annotations[gangv1.AnnotationCommitted] == "" || !strings.HasPrefix(high.Status.Domain, poolOf(1)) {
		t.Fatalf("high gang not placed in the freed clique: %q %+v", high.Status.Domain, high.Status.Conditions)
	}
}
