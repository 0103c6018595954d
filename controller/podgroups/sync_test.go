package podgroups

import (
	"slices"
	"strings"
	"testing"

	schedulingv1alpha3 "k8s.io/api/scheduling/v1alpha3"
	schedulingv1beta1 "k8s.io/api/scheduling/v1beta1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	resourcelisters "k8s.io/client-go/listers/resource/v1"
	alpha3listers "k8s.io/client-go/listers/scheduling/v1alpha3"
	schedulinglisters "k8s.io/client-go/listers/scheduling/v1beta1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/ptr"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/controller/gang"
)

// testAdopter has one managed PodGroup ml/train (annotated, of the given UID
// and minCount) in its lister and no claims.
func testAdopter(t *testing.T, uid types.UID, minCount int32) (*adopter, *schedulingv1beta1.PodGroup) {
	t.Helper()
	pg := &schedulingv1beta1.PodGroup{
		ObjectMeta: metav1.ObjectMeta{Name: "train", Namespace: "ml", UID: uid, Annotations: map[string]string{gangv1.AnnotationManaged: "true"}},
		Spec:       schedulingv1beta1.PodGroupSpec{SchedulingPolicy: schedulingv1beta1.PodGroupSchedulingPolicy{Gang: &schedulingv1beta1.GangSchedulingPolicy{MinCount: minCount}}},
	}
	groups := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc})
	if err := groups.Add(pg); err != nil {
		t.Fatal(err)
	}
	claims := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc})
	dyn := dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(), map[schema.GroupVersionResource]string{gangv1.GroupVersionResource: "GangList"})
	return &adopter{
		loop:   &loop{kind: "PodGroup", recorder: record.NewFakeRecorder(100)},
		gangs:  gang.NewClient(dyn),
		groups: schedulinglisters.NewPodGroupLister(groups),
		claims: resourcelisters.NewResourceClaimLister(claims),
	}, pg
}

// Why a PodGroup is not placed is said once as an event on it, not on every
// look, and said again when it changes or comes back after a placement.
func TestWhyAPodGroupIsNotPlacedIsSaidOnceAsAnEvent(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	a, pg := testAdopter(t, "pg-1", 2)
	events := a.recorder.(*record.FakeRecorder).Events
	groups := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc})
	a.groups = schedulinglisters.NewPodGroupLister(groups)
	set := func(maxSize string) {
		t.Helper()
		p := pg.DeepCopy()
		p.Annotations[gangv1.AnnotationMaxSize] = maxSize
		if err := groups.Update(p); err != nil {
			t.Fatal(err)
		}
		for range 2 {
			if _, err := a.sync(ctx, "ml/train"); err != nil {
				t.Fatal(err)
			}
		}
	}
	said := func() []string {
		var out []string
		for {
			select {
			case e := <-events:
				out = append(out, e)
			default:
				return out
			}
		}
	}
	set("x")
	if got := said(); len(got) != 1 || !strings.Contains(got[0], "Normal "+ReasonNotPlaced+" PodGroup train: annotation gang.tessera.dev/max-size=\"x\"") {
		t.Errorf("events after two looks at a bad max-size: %q, want one saying why", got)
	}
	set("1")
	if got := said(); len(got) != 1 || !strings.Contains(got[0], `max-size="1"`) {
		t.Errorf("events after the reason changed: %q, want one saying the new reason", got)
	}
	set("4")
	if got := said(); len(got) != 0 {
		t.Errorf("events once placed: %q, want none", got)
	}
	if _, err := a.gangs.Get(ctx, "ml", "train"); err != nil {
		t.Fatalf("not placed with a good max-size: %v", err)
	}
	set("x")
	if got := said(); len(got) != 1 {
		t.Errorf("events after the reason came back: %q, want one", got)
	}
}

func TestAPodGroupsGangIsCreatedFollowedAndNeverTaken(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	a, pg := testAdopter(t, "pg-1", 2)
	if again, err := a.sync(ctx, "ml/train"); err != nil || again != 0 {
		t.Fatalf("first sync: again %v, %v", again, err)
	}
	g, err := a.gangs.Get(ctx, "ml", "train")
	if err != nil {
		t.Fatal(err)
	}
	if g.Spec.Size != 2 || g.Spec.PodGroupName != "train" || !metav1.IsControlledBy(g, pg) {
		t.Fatalf("gang %+v owned by %+v, want 2 members of PodGroup train, owned by it", g.Spec, g.OwnerReferences)
	}

	// minCount changes: the gang follows.
	a2, _ := testAdopter(t, "pg-1", 3)
	a2.gangs = a.gangs
	if _, err := a2.sync(ctx, "ml/train"); err != nil {
		t.Fatal(err)
	}
	if g, _ := a.gangs.Get(ctx, "ml", "train"); g.Spec.Size != 3 {
		t.Errorf("gang size %d after minCount 3", g.Spec.Size)
	}

	// The PodGroup is deleted and created again: the old one's gang is still
	// there until the garbage collector takes it; the new one waits, and
	// does not take it over.
	a3, _ := testAdopter(t, "pg-2", 3)
	a3.gangs = a.gangs
	again, err := a3.sync(ctx, "ml/train")
	if err != nil || again != replacedOwnerWait {
		t.Errorf("sync over the old PodGroup's gang: again %v, %v; want a look again in %v", again, err, replacedOwnerWait)
	}
	if g, _ := a.gangs.Get(ctx, "ml", "train"); !metav1.IsControlledBy(g, pg) {
		t.Errorf("the old PodGroup's gang was taken over: owners %+v", g.OwnerReferences)
	}

	// A gang of that name that no PodGroup owns is left alone; the PodGroup
	// looks again now and then, for nothing else says the name is free.
	mine := &gangv1.Gang{ObjectMeta: metav1.ObjectMeta{Name: "train", Namespace: "ml"}, Spec: gangv1.GangSpec{Size: 5, Selector: metav1.LabelSelector{MatchLabels: map[string]string{"app": "x"}}}}
	a4, _ := testAdopter(t, "pg-3", 2)
	if _, err := a4.gangs.Create(ctx, mine); err != nil {
		t.Fatal(err)
	}
	again, err = a4.sync(ctx, "ml/train")
	if err != nil || again != takenNameWait {
		t.Errorf("sync over a user's gang: again %v, %v; want a look again in %v", again, err, takenNameWait)
	}
	if g, _ := a4.gangs.Get(ctx, "ml", "train"); g.Spec.Size != 5 || len(g.OwnerReferences) != 0 {
		t.Errorf("the user's gang changed: %+v, owners %+v", g.Spec, g.OwnerReferences)
	}

	// A PodGroup that is gone has nothing to sync.
	if _, err := a4.sync(ctx, "ml/eval"); err != nil {
		t.Errorf("sync of a missing PodGroup: %v", err)
	}
	if _, err := a4.gangs.Get(ctx, "ml", "eval"); !apierrors.IsNotFound(err) {
		t.Errorf("a gang for a missing PodGroup: %v", err)
	}
}

// A PodGroup whose parent CompositePodGroup has a gang policy is a role of
// the parent's gang and gets no Gang of its own; one whose parent is basic
// is placed alone; one whose parent is not there yet waits. The parent's
// Gang follows the children it has.
func TestAChildPodGroupIsARoleOfItsParentsGangNotAGangOfItsOwn(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	// Indexed as Start indexes them (one index function serves both
	// kinds here: neither has the other's objects).
	newIndexer := func(objs ...any) cache.Indexer {
		idx := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc, byParent: func(o any) ([]string, error) {
			if _, ok := o.(*schedulingv1alpha3.CompositePodGroup); ok {
				return compositeParent(o)
			}
			return podGroupParent(o)
		}})
		for _, o := range objs {
			if err := idx.Add(o); err != nil {
				t.Fatal(err)
			}
		}
		return idx
	}
	cpg := func(gangPolicy bool) *schedulingv1alpha3.CompositePodGroup {
		c := &schedulingv1alpha3.CompositePodGroup{ObjectMeta: metav1.ObjectMeta{Name: "serve", Namespace: "ml", UID: "cpg-1", Annotations: map[string]string{gangv1.AnnotationManaged: "true"}},
			Spec: schedulingv1alpha3.CompositePodGroupSpec{WorkloadRef: &schedulingv1alpha3.WorkloadReference{WorkloadName: "wl", TemplateName: "serve"}}}
		if gangPolicy {
			c.Spec.SchedulingPolicy.Gang = &schedulingv1alpha3.CompositeGangSchedulingPolicy{MinGroupCount: 1}
		} else {
			c.Spec.SchedulingPolicy.Basic = &schedulingv1alpha3.CompositeBasicSchedulingPolicy{}
		}
		return c
	}
	kid := func(name string) *schedulingv1beta1.PodGroup {
		return &schedulingv1beta1.PodGroup{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ml", UID: types.UID("pg-" + name), Annotations: map[string]string{gangv1.AnnotationManaged: "true"}},
			Spec: schedulingv1beta1.PodGroupSpec{ParentCompositePodGroupName: ptr.To("serve"), WorkloadRef: &schedulingv1beta1.WorkloadReference{WorkloadName: "wl", TemplateName: name},
				SchedulingPolicy: schedulingv1beta1.PodGroupSchedulingPolicy{Gang: &schedulingv1beta1.GangSchedulingPolicy{MinCount: 2}}},
		}
	}
	for _, tc := range []struct {
		name   string
		parent *schedulingv1alpha3.CompositePodGroup
		// placedAlone: the child had a gang of its own before (placed
		// where CompositePodGroups were not served).
		placedAlone bool
		alone       bool
	}{
		{"gang parent", cpg(true), false, false},
		// Its own gang stays until deleted; the parent's waits for that.
		{"gang parent of a child placed alone before", cpg(true), true, true},
		{"basic parent", cpg(false), false, true},
		{"basic parent of a child placed alone before", cpg(false), true, true},
		{"no parent yet", nil, false, false},
		{"no parent yet of a child placed alone before", nil, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, _ := testAdopter(t, "pg-1", 2)
			a.groups = schedulinglisters.NewPodGroupLister(newIndexer(kid("prefill")))
			if tc.placedAlone {
				if _, err := a.sync(ctx, "ml/prefill"); err != nil {
					t.Fatal(err)
				}
				if _, err := a.gangs.Get(ctx, "ml", "prefill"); err != nil {
					t.Fatalf("the child was not placed alone where CompositePodGroups are not served: %v", err)
				}
			}
			var cpgs []any
			if tc.parent != nil {
				cpgs = append(cpgs, tc.parent)
			}
			a.composites = alpha3listers.NewCompositePodGroupLister(newIndexer(cpgs...))
			if _, err := a.sync(ctx, "ml/prefill"); err != nil {
				t.Fatal(err)
			}
			if _, err := a.gangs.Get(ctx, "ml", "prefill"); apierrors.IsNotFound(err) == tc.alone {
				t.Errorf("the child's own gang: %v; want one: %v", err, tc.alone)
			}
		})
	}

	// The parent's gang waits while a child still has a gang of its own
	// (its pods would be members of two), and is made once someone deleted
	// it.
	a, _ := testAdopter(t, "pg-1", 2)
	dyn := dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(), map[schema.GroupVersionResource]string{gangv1.GroupVersionResource: "GangList"})
	a.gangs = gang.NewClient(dyn)
	groups := newIndexer(kid("prefill"))
	a.groups = schedulinglisters.NewPodGroupLister(groups)
	if _, err := a.sync(ctx, "ml/prefill"); err != nil {
		t.Fatal(err)
	}
	cpgIndex := newIndexer(cpg(true))
	wl := &schedulingv1beta1.Workload{ObjectMeta: metav1.ObjectMeta{Name: "wl", Namespace: "ml"}, Spec: schedulingv1beta1.WorkloadSpec{
		CompositePodGroupTemplates: []schedulingv1beta1.CompositePodGroupTemplate{{Name: "serve", PodGroupTemplates: []schedulingv1beta1.PodGroupTemplate{{Name: "prefill"}, {Name: "decode"}}}},
	}}
	c := &composer{loop: &loop{kind: "CompositePodGroup"}, gangs: a.gangs, composites: alpha3listers.NewCompositePodGroupLister(cpgIndex), compositeIndex: cpgIndex,
		groups: schedulinglisters.NewPodGroupLister(groups), groupIndex: groups, claims: a.claims,
		workloads: schedulinglisters.NewWorkloadLister(newIndexer(wl))}
	if again, err := c.sync(ctx, "ml/serve"); err != nil || again != takenNameWait {
		t.Errorf("the parent's sync beside the child's own gang: again %v, %v; want a look again in %v", again, err, takenNameWait)
	}
	if _, err := a.gangs.Get(ctx, "ml", "serve"); !apierrors.IsNotFound(err) {
		t.Errorf("the parent's gang was made beside the child's own: %v", err)
	}
	own, err := a.gangs.Get(ctx, "ml", "prefill")
	if err != nil {
		t.Fatal(err)
	}
	if err := dyn.Resource(gangv1.GroupVersionResource).Namespace("ml").Delete(ctx, own.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	roles := func() []string {
		t.Helper()
		if _, err := c.sync(ctx, "ml/serve"); err != nil {
			t.Fatal(err)
		}
		g, err := a.gangs.Get(ctx, "ml", "serve")
		if err != nil {
			t.Fatal(err)
		}
		if o := metav1.GetControllerOf(g); o == nil || o.UID != "cpg-1" {
			t.Errorf("gang owner %+v, want the CompositePodGroup", o)
		}
		var names []string
		for _, r := range g.Spec.Roles {
			names = append(names, r.PodGroupName)
		}
		return names
	}
	if got := roles(); !slices.Equal(got, []string{"prefill"}) {
		t.Errorf("roles %v, want prefill", got)
	}
	if err := groups.Add(kid("decode")); err != nil {
		t.Fatal(err)
	}
	if got := roles(); !slices.Equal(got, []string{"prefill", "decode"}) {
		t.Errorf("roles %v after a second child, want prefill and decode (the Workload's order)", got)
	}
}

// A Gang CRD older than the controller prunes the composite's fields; the
// write says so, naming the fix, rather than leave a gang of no members.
func TestAGangThePrunedCRDStoredIsReported(t *testing.T) {
	want := &gangv1.Gang{ObjectMeta: metav1.ObjectMeta{Name: "serve", Namespace: "ml"}, Spec: gangv1.GangSpec{
		Size: 1, CompositePodGroupName: "serve", Roles: []gangv1.Role{{Name: "a", Size: 1, PodGroupName: "a"}},
	}}
	if err := pruned(want.DeepCopy(), want); err != nil {
		t.Errorf("a gang stored whole: %v", err)
	}
	got := want.DeepCopy()
	got.Spec.CompositePodGroupName, got.Spec.Roles[0].PodGroupName = "", ""
	if err := pruned(got, want); err == nil || !strings.Contains(err.Error(), "apply deployments/crds") {
		t.Errorf("a gang stored pruned: %v, want an error saying to apply the CRD", err)
	}
	got.Spec.CompositePodGroupName = "serve"
	if err := pruned(got, want); err == nil {
		t.Error("a gang stored with its roles' PodGroups pruned: no error")
	}
}
