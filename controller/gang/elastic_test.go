package gang

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

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
		// The scheduler, not the controller, allocates the claim.
		if pinnedTo(p) != "b2" || p.Annotations[gangv1.AnnotationPlacement] != id || c.Annotations[gangv1.AnnotationPlacement] != id || c.Annotations[gangv1.AnnotationSize] != "6" || c.Annotations[gangv1.AnnotationNode] != "b2" || c.Status.Allocation != nil {
			t.Errorf("grown member %s: pinned to %q, placement %q/%q, size %q, node %q, allocated by the controller %v", name, pinnedTo(p), p.Annotations[gangv1.AnnotationPlacement], c.Annotations[gangv1.AnnotationPlacement], c.Annotations[gangv1.AnnotationSize], c.Annotations[gangv1.AnnotationNode], c.Status.Allocation != nil)
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
	f.reconcileOK("g")
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

// A growth cut short after annotating a claim is rolled back from its
// record: the new members stay gated holding nothing, the placement stays
// committed and its running members untouched, and the next look grows
// again.
func TestAnInterruptedGrowthIsRolledBackAloneAndRetried(t *testing.T) {
	f, id := roomForGrowth(t)
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
		c := f.claim("ml", name+"-gpu")
		if c.Status.Allocation != nil {
			t.Errorf("member %s: the controller allocated its claim", name)
		}
		if c.Annotations[gangv1.AnnotationGrowth] == rec.Attempt {
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

// roomForGrowth is an elastic gang of six one-GPU members (min 2) that
// started with four on tray b1 beside a blocker (they run), just after the
// blocker went from tray b2; it returns the placement's ID.
func roomForGrowth(t *testing.T) (*fakeCluster, string) {
	snap, nodes := trays(t, map[string]uint32{"b1": 2, "b2": 2})
	f := newFakeCluster(t, snap, nodes)
	f.runningPod("blocker", "b2", 4, 0)
	f.elasticGang(6, 2, 6)
	id := f.reconcileOK("g").Annotations[gangv1.AnnotationCommitted]
	f.runReleased("m-0", "m-1", "m-2", "m-3")
	f.deleteObject("pods", "blocker")
	f.deleteObject("resourceclaims", "blocker-gpu")
	return f, id
}

// grownGang is roomForGrowth's gang once it grew the other two onto tray
// b2 and they run.
func grownGang(t *testing.T) (*fakeCluster, string) {
	f, id := roomForGrowth(t)
	f.reconcileOK("g")
	f.runReleased("m-4", "m-5")
	return f, id
}

// A growth record naming claims of released members (stale, or forged by
// whoever may write the gang) clears nothing: a growth rollback clears only
// claims its own attempt wrote, of pods still gated, read from the API.
func TestAGrowthRecordNeverClearsARunningMembersClaim(t *testing.T) {
	f, id := grownGang(t)
	attempt := f.claim("ml", "m-4-gpu").Annotations[gangv1.AnnotationGrowth]
	if attempt == "" {
		t.Fatal("a grown member's claim names no growth")
	}
	for _, forged := range []gangv1.UncommittedPlacement{
		{Placement: id, Growth: true, Attempt: attempt, Claims: []string{"m-4-gpu", "m-5-gpu"}},
		{Placement: id, Growth: true, Attempt: "other", Claims: []string{"m-0-gpu", "m-4-gpu"}},
	} {
		g := f.gang("ml", "g")
		raw, _ := json.Marshal(forged)
		g.Annotations[gangv1.AnnotationUncommitted] = string(raw)
		if _, err := f.r.gangs.Update(f.ctx, g); err != nil {
			t.Fatal(err)
		}
		g = f.reconcileOK("g")
		if _, ok := recordOf(g); ok || g.Annotations[gangv1.AnnotationCommitted] != id {
			t.Fatalf("after the record %+v: annotations %v", forged, g.Annotations)
		}
		for _, name := range []string{"m-0", "m-4", "m-5"} {
			if f.claim("ml", name+"-gpu").Status.Allocation == nil {
				t.Fatalf("the record %+v cleared running member %s's claim", forged, name)
			}
		}
	}
}

// A member of an elastic gang that cannot be scheduled where it was placed
// is evicted alone while the rest meet the minimum: the others run on.
func TestAStuckMemberOfAnElasticGangIsEvictedAlone(t *testing.T) {
	f, id := grownGang(t)
	p := f.pod("ml", "m-5")
	p.Spec.NodeName = ""
	p.Status.Phase = v1.PodPending
	p.Status.Conditions = []v1.PodCondition{{Type: v1.PodScheduled, Status: v1.ConditionFalse, Reason: v1.PodReasonUnschedulable,
		Message: "0/2 nodes are available: 1 Insufficient cpu", LastTransitionTime: metav1.NewTime(time.Now().Add(-2 * time.Minute))}}
	if err := f.client.Tracker().Update(v1.SchemeGroupVersion.WithResource("pods"), p, "ml"); err != nil {
		t.Fatal(err)
	}
	g := f.reconcileOK("g")
	failed := meta.FindStatusCondition(g.Status.Conditions, gangv1.ConditionFailed)
	if !slices.Equal(f.evicted, []string{"m-5"}) || g.Annotations[gangv1.AnnotationCommitted] != id || failed == nil || failed.Reason != gangv1.ReasonShrunk ||
		!strings.Contains(failed.Message, "member m-5 cannot be scheduled on the node it was placed on") {
		t.Fatalf("evicted %v, committed %q, Failed %+v; want m-5 alone evicted and the gang going on", f.evicted, g.Annotations[gangv1.AnnotationCommitted], failed)
	}
}

// A growth cut after its commit, before the release, keeps the ranks its
// claims were written with: the release writes the same rank on the pod,
// and a later replacement takes a free rank, never one of theirs.
func TestAGrowthCutBeforeTheReleaseKeepsItsRanks(t *testing.T) {
	f, _ := roomForGrowth(t)
	f.r.interrupt = func(step string) bool { return step == StepRelease }
	if _, err := f.reconcile("ml", "g"); err == nil {
		t.Fatal("growth not interrupted")
	}
	f.r.interrupt = nil
	// Meanwhile m-1 fails: by name the gated m-4 and m-5 would now rank 3
	// and 4.
	f.setPhase("m-1", v1.PodFailed)
	f.deleteObject("resourceclaims", "m-1-gpu")
	f.reconcileOK("g")
	for name, want := range map[string]string{"m-4": "4", "m-5": "5"} {
		if p, c := f.pod("ml", name), f.claim("ml", name+"-gpu"); hasGate(p) || p.Annotations[gangv1.AnnotationRank] != want || c.Annotations[gangv1.AnnotationRank] != want {
			t.Errorf("%s: gated %v, rank %q on the pod and %q on the claim, want %s on both", name, hasGate(p), p.Annotations[gangv1.AnnotationRank], c.Annotations[gangv1.AnnotationRank], want)
		}
	}
	f.member("m-9", map[string]string{"gang": "g"}, 1)
	f.reconcileOK("g")
	if got := f.pod("ml", "m-9").Annotations[gangv1.AnnotationRank]; got != "1" {
		t.Errorf("replacement rank %q, want 1", got)
	}
}

// A gang with an elastic role grows that role (the growth has no minimum of
// its own), and keeps the launcher's rank.
func TestAnElasticRoleGrows(t *testing.T) {
	snap, nodes := trays(t, map[string]uint32{"b1": 2, "b2": 2})
	f := newFakeCluster(t, snap, nodes)
	f.runningPod("blocker", "b2", 4, 0)
	f.create(newClaim("domain", "domain.gpu.tessera.dev", 1))
	f.member("launcher", map[string]string{"gang": "g", "role": "launcher"}, 1)
	for i := range 5 {
		f.member(fmt.Sprintf("w-%d", i), map[string]string{"gang": "g", "role": "worker"}, 1)
	}
	g := labelGangOf("g", 6, "domain")
	g.Spec.Roles = []gangv1.Role{
		{Name: "launcher", Size: 1, Selector: metav1.LabelSelector{MatchLabels: map[string]string{"role": "launcher"}}},
		{Name: "workers", Size: 5, MinSize: 2, Selector: metav1.LabelSelector{MatchLabels: map[string]string{"role": "worker"}}},
	}
	if _, err := f.r.gangs.Create(f.ctx, g); err != nil {
		t.Fatal(err)
	}
	f.reconcileOK("g")
	if got := f.released("launcher", "w-0", "w-1", "w-2", "w-3", "w-4"); !sameMap(got, map[string]string{"launcher": "0", "w-0": "1", "w-1": "2", "w-2": "3"}) {
		t.Fatalf("released %v, want the launcher and three workers that fit", got)
	}
	f.runReleased("launcher", "w-0", "w-1", "w-2")
	f.deleteObject("pods", "blocker")
	f.deleteObject("resourceclaims", "blocker-gpu")
	f.reconcileOK("g")
	if got := f.released("w-3", "w-4"); !sameMap(got, map[string]string{"w-3": "4", "w-4": "5"}) {
		t.Fatalf("after room appeared: released %v, want w-3 and w-4 with ranks 4 and 5", got)
	}
	if r := f.pod("ml", "w-4").Annotations[gangv1.AnnotationRoleRank]; r != "4" {
		t.Errorf("w-4's role rank %q, want 4", r)
	}
}

// Stable ranks: a released member keeps its rank unless it is out of range
// or taken; a newcomer takes its completion index when free, else the
// lowest rank free; a succeeded member's rank is never handed out again.
func TestKeepRanksKeepsReleasedRanksAndFillsTheLowestFree(t *testing.T) {
	mk := func(name, index, rank string, released bool) *member {
		p := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{}, Annotations: map[string]string{}}}
		if index != "" {
			p.Labels[jobIndexLabel] = index
		}
		if released {
			p.Annotations[gangv1.AnnotationPlacement], p.Annotations[gangv1.AnnotationRank] = "p1", rank
		} else {
			p.Spec.SchedulingGates = []v1.PodSchedulingGate{{Name: gangv1.SchedulingGate}}
		}
		return &member{pod: p}
	}
	for _, tc := range []struct {
		name      string
		group     []*member
		succeeded []int
		want      map[string]int
	}{
		{"by name: the lowest free", []*member{mk("a", "", "2", true), mk("b", "", "0", true), mk("z", "", "", false)}, nil, map[string]int{"a": 2, "b": 0, "z": 1}},
		{"a succeeded member's rank stays its own", []*member{mk("b", "", "1", true), mk("z", "", "", false)}, []int{0}, map[string]int{"b": 1, "z": 2}},
		{"a replacement takes its free completion index", []*member{mk("a", "0", "0", true), mk("b", "1", "1", true), mk("c", "3", "", false)}, nil, map[string]int{"a": 0, "b": 1, "c": 3}},
		{"a kept rank out of range is given again", []*member{mk("a", "", "7", true), mk("b", "", "0", true)}, nil, map[string]int{"a": 1, "b": 0}},
		{"two claiming one rank: the second gets a free one", []*member{mk("a", "", "1", true), mk("b", "", "1", true)}, nil, map[string]int{"a": 1, "b": 0}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			byIndex := rankGroup(tc.group)
			taken := map[int]bool{}
			for _, r := range tc.succeeded {
				taken[r] = true
			}
			keepRanks(tc.group, "p1", gangv1.AnnotationRank, 4, byIndex, taken)
			got := map[string]int{}
			for _, m := range tc.group {
				got[m.pod.Name] = m.rank
			}
			for name, want := range tc.want {
				if got[name] != want {
					t.Errorf("ranks %v, want %v", got, tc.want)
					break
				}
			}
		})
	}
}

// A gang whose minimum is its maximum is a fixed gang: a member that
// vanishes is noticed and the gang placed again.
func TestAnElasticGangOfEqualBoundsIsRepairedAsAFixedOne(t *testing.T) {
	snap, nodes := trays(t, map[string]uint32{"b1": 2})
	f := newFakeCluster(t, snap, nodes)
	f.elasticGang(3, 3, 3)
	if g := f.reconcileOK("g"); g.Annotations[gangv1.AnnotationCommitted] == "" {
		t.Fatalf("not placed: %+v", g.Status.Conditions)
	}
	f.runReleased("m-0", "m-1", "m-2")
	f.deleteObject("pods", "m-2")
	g := f.reconcileOK("g")
	slices.Sort(f.evicted)
	if !slices.Equal(f.evicted, []string{"m-0", "m-1"}) || g.Annotations[gangv1.AnnotationCommitted] != "" {
		t.Fatalf("evicted %v, committed %q; want the rest evicted and the placement forgotten", f.evicted, g.Annotations[gangv1.AnnotationCommitted])
	}
}

// An elastic gang of a PodGroup's pods starts only with all of them, not
// with those that fit: kube-scheduler binds none of a group's pods while
// one is gated, so released members beside gated ones would wait for ever.
// The waiting message says so. Once all fit, all are released.
func TestAnElasticPodGroupsGangStartsWithEveryPodItHas(t *testing.T) {
	snap, nodes := trays(t, map[string]uint32{"b1": 2, "b2": 2})
	f := newFakeCluster(t, snap, nodes)
	f.runningPod("blocker", "b2", 4, 0)
	f.create(newClaim("domain", "domain.gpu.tessera.dev", 1))
	all := []string{"m-0", "m-1", "m-2", "m-3", "m-4", "m-5"}
	for _, name := range all {
		f.memberOf(name, "domain", nil, 1, func(p *v1.Pod) {
			p.Spec.SchedulingGroup = &v1.PodSchedulingGroup{PodGroupName: ptr.To("g")}
		})
	}
	g := &gangv1.Gang{ObjectMeta: metav1.ObjectMeta{Name: "g", Namespace: "ml", UID: "uid-gang-g"},
		Spec: gangv1.GangSpec{MinSize: 3, MaxSize: 6, PodGroupName: "g", DomainClaimName: "domain"}}
	if _, err := f.r.gangs.Create(f.ctx, g); err != nil {
		t.Fatal(err)
	}

	g = f.reconcileOK("g")
	if got := f.released(all...); len(got) != 0 || g.Annotations[gangv1.AnnotationCommitted] != "" {
		t.Fatalf("released %v (committed %q) while only four of six fit; want none", got, g.Annotations[gangv1.AnnotationCommitted])
	}
	if w := meta.FindStatusCondition(g.Status.Conditions, gangv1.ConditionWaiting); w == nil || w.Reason != gangv1.ReasonNoDomainFits || !strings.Contains(w.Message, "all 6 members (a PodGroup's gang starts with every pod it has") {
		t.Fatalf("waiting: %+v", w)
	}

	f.deleteObject("pods", "blocker")
	f.deleteObject("resourceclaims", "blocker-gpu")
	g = f.reconcileOK("g")
	if got := f.released(all...); len(got) != 6 || g.Annotations[gangv1.AnnotationCommitted] == "" {
		t.Fatalf("released %v once all fit; want all six", got)
	}
}
