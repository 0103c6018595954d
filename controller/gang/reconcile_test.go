package gang

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	"k8s.io/client-go/kubernetes/fake"
	corelisters "k8s.io/client-go/listers/core/v1"
	policylisters "k8s.io/client-go/listers/policy/v1"
	resourcelisters "k8s.io/client-go/listers/resource/v1"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/ptr"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/driver/simulate"
)

// fakeCluster runs the reconciler against fake API clients: a clientset
// holding classes, slices, nodes, pods and claims, and a dynamic client
// holding gangs. Its listers are refilled from the clientset before each
// reconcile, so every reconcile sees what the previous one wrote.
type fakeCluster struct {
	t       *testing.T
	ctx     context.Context
	client  *fake.Clientset
	r       *reconciler
	events  *record.FakeRecorder
	evicted []string
	pods    cache.Indexer
	claims  cache.Indexer
	nodes   cache.Indexer
	rules   cache.Indexer
	budgets cache.Indexer
	// onReconcile, if set, runs once the listers are refilled, before the
	// reconcile.
	onReconcile func()
}

func newFakeCluster(t *testing.T, snap *simulate.Snapshot, nodes map[string]*v1.Node) *fakeCluster {
	t.Helper()
	_, ctx := ktesting.NewTestContext(t)
	var objs []runtime.Object
	for _, c := range snap.Classes {
		objs = append(objs, c)
	}
	for _, s := range snap.Slices {
		objs = append(objs, s)
	}
	for _, n := range nodes {
		objs = append(objs, n)
	}
	f := &fakeCluster{
		t: t, ctx: ctx, client: fake.NewClientset(objs...), events: record.NewFakeRecorder(100),
		pods:    cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc}),
		claims:  cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc}),
		nodes:   cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{}),
		rules:   cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{}),
		budgets: cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc}),
	}
	// Eviction deletes the pod, as the API server does without a budget.
	f.client.PrependReactor("create", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.GetSubresource() != "eviction" {
			return false, nil, nil
		}
		name := a.(k8stesting.CreateAction).GetObject().(metav1.Object).GetName()
		f.evicted = append(f.evicted, name)
		return true, nil, f.client.Tracker().Delete(v1.SchemeGroupVersion.WithResource("pods"), a.GetNamespace(), name)
	})
	dyn := dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(), map[schema.GroupVersionResource]string{gangv1.GroupVersionResource: "GangList"})
	f.r = &reconciler{
		client: f.client, gangs: NewClient(dyn), driver: driver,
		pods: corelisters.NewPodLister(f.pods), claims: resourcelisters.NewResourceClaimLister(f.claims), nodes: corelisters.NewNodeLister(f.nodes),
		recorder: f.events, unschedulableGrace: time.Minute,
		taintRules: resourcelisters.NewDeviceTaintRuleLister(f.rules),
		budgets:    policylisters.NewPodDisruptionBudgetLister(f.budgets),
	}
	f.r.allGangs = func() []*gangv1.Gang {
		gs, err := f.r.gangs.List(f.ctx)
		if err != nil {
			t.Fatal(err)
		}
		return gs
	}
	return f
}

// create adds objects to the clientset.
func (f *fakeCluster) create(objs ...runtime.Object) {
	f.t.Helper()
	for _, o := range objs {
		if err := f.client.Tracker().Add(o); err != nil {
			f.t.Fatal(err)
		}
	}
}

// reconcile refills the listers and reconciles the gang once.
func (f *fakeCluster) reconcile(ns, name string) (result, error) {
	f.t.Helper()
	pods, err := f.client.CoreV1().Pods("").List(f.ctx, metav1.ListOptions{})
	if err != nil {
		f.t.Fatal(err)
	}
	claims, err := f.client.ResourceV1().ResourceClaims("").List(f.ctx, metav1.ListOptions{})
	if err != nil {
		f.t.Fatal(err)
	}
	nodes, err := f.client.CoreV1().Nodes().List(f.ctx, metav1.ListOptions{})
	if err != nil {
		f.t.Fatal(err)
	}
	var items []any
	for i := range pods.Items {
		items = append(items, &pods.Items[i])
	}
	_ = f.pods.Replace(items, "")
	items = nil
	for i := range claims.Items {
		items = append(items, &claims.Items[i])
	}
	_ = f.claims.Replace(items, "")
	items = nil
	for i := range nodes.Items {
		items = append(items, &nodes.Items[i])
	}
	_ = f.nodes.Replace(items, "")
	rules, err := f.client.ResourceV1().DeviceTaintRules().List(f.ctx, metav1.ListOptions{})
	if err != nil {
		f.t.Fatal(err)
	}
	items = nil
	for i := range rules.Items {
		items = append(items, &rules.Items[i])
	}
	_ = f.rules.Replace(items, "")
	budgets, err := f.client.PolicyV1().PodDisruptionBudgets("").List(f.ctx, metav1.ListOptions{})
	if err != nil {
		f.t.Fatal(err)
	}
	items = nil
	for i := range budgets.Items {
		items = append(items, &budgets.Items[i])
	}
	_ = f.budgets.Replace(items, "")
	if f.onReconcile != nil {
		f.onReconcile()
	}
	return f.r.reconcile(f.ctx, ns, name)
}

func (f *fakeCluster) claim(ns, name string) *resourceapi.ResourceClaim {
	f.t.Helper()
	c, err := f.client.ResourceV1().ResourceClaims(ns).Get(f.ctx, name, metav1.GetOptions{})
	if err != nil {
		f.t.Fatal(err)
	}
	return c
}

func (f *fakeCluster) gang(ns, name string) *gangv1.Gang {
	f.t.Helper()
	g, err := f.r.gangs.Get(f.ctx, ns, name)
	if err != nil {
		f.t.Fatal(err)
	}
	return g
}

// drainEvents returns the events recorded so far.
func (f *fakeCluster) drainEvents() []string {
	var out []string
	for {
		select {
		case e := <-f.events.Events:
			out = append(out, e)
		default:
			return out
		}
	}
}

// gangMembers creates gang ml/g of n members labelled gang=g, each gated
// with its own one-GPU claim <pod>-gpu, sharing domain claim "domain";
// change, if given, edits the gang before it is created.
func (f *fakeCluster) gangMembers(n int, change ...func(*gangv1.Gang)) {
	f.t.Helper()
	f.create(newClaim("domain", "domain.gpu.tessera.dev", 1))
	for i := range n {
		f.member(fmt.Sprintf("m-%d", i), map[string]string{"gang": "g"}, 1)
	}
	g := labelGangOf("g", int32(n), "domain")
	for _, c := range change {
		c(g)
	}
	if _, err := f.r.gangs.Create(f.ctx, g); err != nil {
		f.t.Fatal(err)
	}
}

// member creates a gated pod ml/<name> sharing domain claim "domain", with
// its own claim <name>-gpu of gpus GPUs (none when gpus is 0).
func (f *fakeCluster) member(name string, labels map[string]string, gpus int64) {
	f.t.Helper()
	f.memberOf(name, "domain", labels, gpus, nil)
}

// memberOf is member with the gang's domain claim named domainClaim, and
// edit, if set, applied to the pod before it is created.
func (f *fakeCluster) memberOf(name, domainClaim string, labels map[string]string, gpus int64, edit func(*v1.Pod)) {
	f.t.Helper()
	pod := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ml", UID: types.UID("uid-pod-" + name), Labels: labels},
		Spec: v1.PodSpec{
			SchedulingGates: []v1.PodSchedulingGate{{Name: gangv1.SchedulingGate}},
			ResourceClaims:  []v1.PodResourceClaim{{Name: "domain", ResourceClaimName: ptr.To(domainClaim)}},
		},
		Status: v1.PodStatus{Phase: v1.PodPending},
	}
	if edit != nil {
		edit(pod)
	}
	if gpus == 0 {
		f.create(pod)
		return
	}
	pod.Spec.ResourceClaims = append([]v1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: ptr.To("gpus")}}, pod.Spec.ResourceClaims...)
	pod.Status.ResourceClaimStatuses = []v1.PodResourceClaimStatus{{Name: "gpu", ResourceClaimName: ptr.To(name + "-gpu")}}
	claim := newClaim(name+"-gpu", "gpu.tessera.dev", gpus)
	claim.OwnerReferences = []metav1.OwnerReference{{APIVersion: "v1", Kind: "Pod", Name: name, UID: pod.UID, Controller: ptr.To(true)}}
	f.create(pod, claim)
}

// pod reads a pod back.
func (f *fakeCluster) pod(ns, name string) *v1.Pod {
	f.t.Helper()
	p, err := f.client.CoreV1().Pods(ns).Get(f.ctx, name, metav1.GetOptions{})
	if err != nil {
		f.t.Fatal(err)
	}
	return p
}

// pinnedTo is the node a released member was pinned to ("" if none).
func pinnedTo(p *v1.Pod) string {
	if p.Spec.Affinity == nil || p.Spec.Affinity.NodeAffinity == nil || p.Spec.Affinity.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution == nil {
		return ""
	}
	for _, term := range p.Spec.Affinity.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms {
		for _, f := range term.MatchFields {
			if f.Key == "metadata.name" && len(f.Values) == 1 {
				return f.Values[0]
			}
		}
	}
	return ""
}

func labelGangOf(name string, size int32, domain string) *gangv1.Gang {
	return &gangv1.Gang{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ml", UID: types.UID("uid-gang-" + name)},
		Spec: gangv1.GangSpec{Size: size, DomainClaimName: domain,
			Selector: metav1.LabelSelector{MatchLabels: map[string]string{"gang": name}}},
	}
}

// An interrupted placement is rolled back from what it wrote, even when the
// gang's spec changed meanwhile so that its members are no longer the pods
// the claims were written for, or the spec is no longer valid.
func TestAnInterruptedPlacementIsRolledBackWhateverTheSpecSaysNow(t *testing.T) {
	for _, tc := range []struct {
		name   string
		change func(*gangv1.Gang)
	}{
		{"the selector now picks other pods", func(g *gangv1.Gang) { g.Spec.Selector.MatchLabels = map[string]string{"gang": "other"} }},
		{"the spec is no longer valid", func(g *gangv1.Gang) { g.Spec.Selector = metav1.LabelSelector{} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			snap, nodes := trays(t, map[string]uint32{"a1": 1})
			f := newFakeCluster(t, snap, nodes)
			f.gangMembers(2)
			var writes atomic.Int32
			f.r.interrupt = func(step string) bool { return step == StepClaimWritten && writes.Add(1) == 1 }
			if _, err := f.reconcile("ml", "g"); err != errInterrupted {
				t.Fatalf("first reconcile: %v, want it interrupted after a claim was written", err)
			}
			var allocated []string
			for _, name := range []string{"m-0-gpu", "m-1-gpu", "domain"} {
				if f.claim("ml", name).Status.Allocation != nil {
					allocated = append(allocated, name)
				}
			}
			if len(allocated) == 0 {
				t.Fatal("nothing written before the interruption: the test does not exercise a cut placement")
			}
			g := f.gang("ml", "g")
			tc.change(g)
			if _, err := f.r.gangs.Update(f.ctx, g); err != nil {
				t.Fatal(err)
			}
			f.r.interrupt = nil
			for range 3 {
				if _, err := f.reconcile("ml", "g"); err != nil {
					t.Fatal(err)
				}
			}
			for _, name := range allocated {
				if a := f.claim("ml", name).Status.Allocation; a != nil {
					t.Errorf("claim %s written before the interruption is still allocated: %+v", name, a.Devices.Results)
				}
			}
			if events := strings.Join(f.drainEvents(), "\n"); !strings.Contains(events, gangv1.ReasonRolledBack) {
				t.Errorf("no %s event; events:\n%s", gangv1.ReasonRolledBack, events)
			}
		})
	}
}

// placedGang places gang ml/g of two members on tray a1 and binds them
// there as the scheduler would: m-0 runs, m-1 waits on the node (Pending),
// bound since boundFor ago. It returns m-1's GPU claim.
func (f *fakeCluster) placedGang(boundFor time.Duration) *resourceapi.ResourceClaim {
	f.t.Helper()
	f.gangMembers(2)
	if _, err := f.reconcile("ml", "g"); err != nil {
		f.t.Fatal(err)
	}
	if f.gang("ml", "g").Annotations[gangv1.AnnotationCommitted] == "" {
		f.t.Fatal("the gang was not placed")
	}
	f.allocateReleased("m-0", "m-1")
	for _, name := range []string{"m-0", "m-1"} {
		p, err := f.client.CoreV1().Pods("ml").Get(f.ctx, name, metav1.GetOptions{})
		if err != nil {
			f.t.Fatal(err)
		}
		if len(p.Spec.SchedulingGates) != 0 {
			f.t.Fatalf("member %s not released", name)
		}
		p.Spec.NodeName = "a1"
		p.Status.Phase = v1.PodRunning
		p.Status.Conditions = []v1.PodCondition{{Type: v1.PodScheduled, Status: v1.ConditionTrue, LastTransitionTime: metav1.NewTime(time.Now().Add(-boundFor))}}
		if name == "m-1" {
			p.Status.Phase = v1.PodPending
		}
		if err := f.client.Tracker().Update(v1.SchemeGroupVersion.WithResource("pods"), p, "ml"); err != nil {
			f.t.Fatal(err)
		}
	}
	return f.claim("ml", "m-1-gpu")
}

// rivalOf allocates a claim of another workload the device of member's
// claim, as the scheduler does when it allocates in the same moment the
// controller writes the member's claim.
func (f *fakeCluster) rivalOf(member *resourceapi.ResourceClaim) {
	f.t.Helper()
	rival := newClaim("rival", "gpu.tessera.dev", 1)
	r := member.Status.Allocation.Devices.Results[0]
	r.Request = "r"
	rival.Status.Allocation = &resourceapi.AllocationResult{
		Devices:      resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{r}},
		NodeSelector: member.Status.Allocation.NodeSelector,
	}
	rival.Status.ReservedFor = []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: "small", UID: "uid-small"}}
	f.create(rival)
}

// A member bound to its node but refused at prepare (another claim was
// allocated its device in the moment the placement was written) would
// leave the gang holding every device with a member short forever: once
// it has not started for the grace period, the gang is handled as one that
// lost a member, with an event naming the device and the other claim.
func TestABoundMemberWhoseDeviceIsAllocatedTwiceIsLost(t *testing.T) {
	t.Run("past the grace", func(t *testing.T) {
		snap, nodes := trays(t, map[string]uint32{"a1": 1})
		f := newFakeCluster(t, snap, nodes)
		f.rivalOf(f.placedGang(2 * time.Minute))
		f.drainEvents()
		if _, err := f.reconcile("ml", "g"); err != nil {
			t.Fatal(err)
		}
		events := strings.Join(f.drainEvents(), "\n")
		if !strings.Contains(events, gangv1.ReasonMemberLost) || !strings.Contains(events, "member m-1") || !strings.Contains(events, "claim ml/rival") {
			t.Errorf("no %s event naming member m-1 and claim ml/rival; events:\n%s", gangv1.ReasonMemberLost, events)
		}
		if len(f.evicted) != 2 {
			t.Errorf("evicted %v, want both members", f.evicted)
		}
		if id := f.gang("ml", "g").Annotations[gangv1.AnnotationCommitted]; id != "" {
			t.Errorf("the lost placement %s is still committed", id)
		}
	})
	t.Run("within the grace", func(t *testing.T) {
		snap, nodes := trays(t, map[string]uint32{"a1": 1})
		f := newFakeCluster(t, snap, nodes)
		f.rivalOf(f.placedGang(20 * time.Second))
		res, err := f.reconcile("ml", "g")
		if err != nil {
			t.Fatal(err)
		}
		if len(f.evicted) != 0 || res.requeueAfter <= 0 || res.requeueAfter > 40*time.Second {
			t.Errorf("evicted %v, look again in %v; want nothing evicted yet and a look again within 40s", f.evicted, res.requeueAfter)
		}
	})
	t.Run("no device allocated twice", func(t *testing.T) {
		snap, nodes := trays(t, map[string]uint32{"a1": 1})
		f := newFakeCluster(t, snap, nodes)
		f.placedGang(2 * time.Minute)
		if _, err := f.reconcile("ml", "g"); err != nil {
			t.Fatal(err)
		}
		if len(f.evicted) != 0 {
			t.Errorf("evicted %v: a member slow to start without a double allocation is not lost", f.evicted)
		}
	})
}

// A member refused at prepare while another claim held its device, whose
// device is free again, is not lost: its kubelet would retry only at its
// next resync (60 to 90 s later), so the controller changes the member's
// prepare-retry annotation, which makes the kubelet sync it at once: 10 s
// after the bind (the kubelet's own back-off after a failed sync), well
// within the grace (1m here), then at most once per 10 s, and only for a
// member whose sandbox is not made (its claims not prepared).
func TestALateMemberWhoseDeviceIsFreeAgainIsPreparedAgain(t *testing.T) {
	// podUpdates counts the controller's updates of pods so far (releases
	// included).
	podUpdates := func(f *fakeCluster) (n int) {
		for _, a := range f.client.Actions() {
			if a.GetVerb() == "update" && a.GetResource().Resource == "pods" && a.GetSubresource() == "" {
				n++
			}
		}
		return n
	}
	retried := func(t *testing.T, f *fakeCluster, name string) string {
		p, err := f.client.CoreV1().Pods("ml").Get(f.ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return p.Annotations[gangv1.AnnotationPrepareRetry]
	}
	setRetried := func(t *testing.T, f *fakeCluster, name, at string) {
		p, err := f.client.CoreV1().Pods("ml").Get(f.ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		p.Annotations[gangv1.AnnotationPrepareRetry] = at
		if err := f.client.Tracker().Update(v1.SchemeGroupVersion.WithResource("pods"), p, "ml"); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		name    string
		bound   time.Duration
		sandbox bool
		// retriedAt, if set, is m-1's annotation before the reconcile;
		// retriedAgo, if set, makes it that long before the subtest runs
		// (not before the table is built: earlier subtests take seconds).
		retriedAt  string
		retriedAgo time.Duration
		want       int
	}{
		{name: "bound 20 s, within the grace", bound: 20 * time.Second, want: 1},
		{name: "bound 2 min, past the grace", bound: 2 * time.Minute, want: 1},
		{name: "bound 5 s", bound: 5 * time.Second, want: 0},
		{name: "asked 3 s ago", bound: 2 * time.Minute, retriedAgo: 3 * time.Second, want: 0},
		{name: "asked 30 s ago", bound: 2 * time.Minute, retriedAgo: 30 * time.Second, want: 1},
		{name: "asked in the future", bound: 2 * time.Minute, retriedAgo: -time.Hour, want: 1},
		{name: "asked at no time", bound: 2 * time.Minute, retriedAt: "soon", want: 1},
		{name: "sandbox made (images pulling)", bound: 2 * time.Minute, sandbox: true, want: 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			snap, nodes := trays(t, map[string]uint32{"a1": 1})
			f := newFakeCluster(t, snap, nodes)
			f.placedGang(tc.bound)
			if tc.retriedAgo != 0 {
				tc.retriedAt = time.Now().Add(-tc.retriedAgo).UTC().Format(time.RFC3339)
			}
			if tc.retriedAt != "" {
				setRetried(t, f, "m-1", tc.retriedAt)
			}
			if tc.sandbox {
				p, err := f.client.CoreV1().Pods("ml").Get(f.ctx, "m-1", metav1.GetOptions{})
				if err != nil {
					t.Fatal(err)
				}
				p.Status.Conditions = append(p.Status.Conditions, v1.PodCondition{Type: v1.PodReadyToStartContainers, Status: v1.ConditionTrue})
				if err := f.client.Tracker().Update(v1.SchemeGroupVersion.WithResource("pods"), p, "ml"); err != nil {
					t.Fatal(err)
				}
			}
			released := podUpdates(f)
			before := time.Now().Add(-time.Second).Truncate(time.Second)
			res, err := f.reconcile("ml", "g")
			if err != nil {
				t.Fatal(err)
			}
			if len(f.evicted) != 0 {
				t.Errorf("evicted %v: a member whose devices are free is not lost", f.evicted)
			}
			if n := podUpdates(f) - released; n != tc.want {
				t.Fatalf("%d pod updates, want %d", n, tc.want)
			}
			if at := retried(t, f, "m-0"); at != "" {
				t.Errorf("running member m-0 was asked to prepare again (%s)", at)
			}
			if tc.want == 1 {
				if when, err := time.Parse(time.RFC3339, retried(t, f, "m-1")); err != nil || when.Before(before) || when.After(time.Now()) {
					t.Errorf("m-1: %s = %q, want the time of the reconcile", gangv1.AnnotationPrepareRetry, retried(t, f, "m-1"))
				}
				// A second look within 10 s asks nothing more.
				if _, err := f.reconcile("ml", "g"); err != nil {
					t.Fatal(err)
				}
				if n := podUpdates(f) - released; n != 1 {
					t.Errorf("%d pod updates after a second look at once, want still 1", n)
				}
			}
			if res.requeueAfter <= 0 || res.requeueAfter > 10*time.Second && !tc.sandbox {
				t.Errorf("look again in %v, want within 10 s", res.requeueAfter)
			}
		})
	}
}
