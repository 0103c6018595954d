package gang

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/driver/simulate"
)

// prioGang creates gang ml/<name> of n members <name>-<i> (label
// gang=<name>) of priority, each with its own claim of gpus GPUs, sharing
// domain claim <name>-domain; edit, if set, changes each pod.
func (f *fakeCluster) prioGang(name string, n int, gpus int64, priority int32, edit func(*v1.Pod)) {
	f.t.Helper()
	f.create(newClaim(name+"-domain", "domain.gpu.tessera.dev", 1))
	for i := range n {
		f.memberOf(fmt.Sprintf("%s-%d", name, i), name+"-domain", map[string]string{"gang": name}, gpus, func(p *v1.Pod) {
			p.Spec.Priority = ptr.To(priority)
			if edit != nil {
				edit(p)
			}
		})
	}
	if _, err := f.r.gangs.Create(f.ctx, labelGangOf(name, int32(n), name+"-domain")); err != nil {
		f.t.Fatal(err)
	}
}

// allocateReleased allocates each released pod's own claims on the node it
// is pinned to and reserves them for it, as the scheduler does (with the
// scheduler's allocator over the claims as they are now): the controller
// allocates none of them.
func (f *fakeCluster) allocateReleased(names ...string) {
	f.t.Helper()
	for _, name := range names {
		p := f.pod("ml", name)
		if len(p.Spec.SchedulingGates) != 0 || pinnedTo(p) == "" {
			f.t.Fatalf("pod %s is not released to a node", name)
		}
		n, err := f.client.CoreV1().Nodes().Get(f.ctx, pinnedTo(p), metav1.GetOptions{})
		if err != nil {
			f.t.Fatal(err)
		}
		for _, st := range p.Status.ResourceClaimStatuses {
			c := f.claim("ml", *st.ResourceClaimName)
			if c.Status.Allocation != nil {
				continue
			}
			snap, err := simulate.List(f.ctx, f.client, nil)
			if err != nil {
				f.t.Fatal(err)
			}
			res, err := snap.Cluster(nil, nil).AllocateOnNode(f.ctx, n, c)
			if err != nil || len(res) != 1 {
				f.t.Fatalf("the scheduler cannot allocate claim %s of %s on %s: %v %v", c.Name, name, n.Name, res, err)
			}
			c.Status.Allocation = &res[0]
			c.Status.ReservedFor = []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: name, UID: p.UID}}
			if _, err := f.client.ResourceV1().ResourceClaims("ml").UpdateStatus(f.ctx, c, metav1.UpdateOptions{}); err != nil {
				f.t.Fatal(err)
			}
		}
	}
}

// runReleased allocates released pods' claims and binds the pods to the
// node they are pinned to, running, as the scheduler and the kubelet would.
func (f *fakeCluster) runReleased(names ...string) {
	f.t.Helper()
	f.allocateReleased(names...)
	for _, name := range names {
		p := f.pod("ml", name)
		p.Spec.NodeName = pinnedTo(p)
		p.Status.Phase = v1.PodRunning
		if err := f.client.Tracker().Update(v1.SchemeGroupVersion.WithResource("pods"), p, "ml"); err != nil {
			f.t.Fatal(err)
		}
	}
}

// runningPod creates pod ml/<name> of priority running on node, holding a
// claim of gpus GPUs that the allocator gives it there.
func (f *fakeCluster) runningPod(name, node string, gpus int64, priority int32, edit ...func(*v1.Pod, *resourceapi.ResourceClaim)) {
	f.t.Helper()
	pod := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ml", UID: types.UID("uid-pod-" + name), Labels: map[string]string{"app": name}},
		Spec: v1.PodSpec{NodeName: node, Priority: ptr.To(priority),
			ResourceClaims: []v1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: ptr.To("gpus")}}},
		Status: v1.PodStatus{Phase: v1.PodRunning, ResourceClaimStatuses: []v1.PodResourceClaimStatus{{Name: "gpu", ResourceClaimName: ptr.To(name + "-gpu")}}},
	}
	claim := newClaim(name+"-gpu", "gpu.tessera.dev", gpus)
	for _, e := range edit {
		e(pod, claim)
	}
	res, _, err := f.allocateAsScheduler(claim, node)
	if err != nil || len(res) != 1 {
		f.t.Fatalf("allocate %d GPUs on %s for %s: %v %v", gpus, node, name, res, err)
	}
	claim.Status.Allocation = &res[0]
	claim.Status.ReservedFor = []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: name, UID: pod.UID}}
	f.create(pod, claim)
}

// freeClaimsOfGonePods deletes the claims reserved only for pods that no
// longer exist, as the resourceclaim controller does.
func (f *fakeCluster) freeClaimsOfGonePods() {
	f.t.Helper()
	claims, err := f.client.ResourceV1().ResourceClaims("ml").List(f.ctx, metav1.ListOptions{})
	if err != nil {
		f.t.Fatal(err)
	}
	for _, c := range claims.Items {
		gone := len(c.Status.ReservedFor) > 0
		for _, ref := range c.Status.ReservedFor {
			if _, err := f.client.CoreV1().Pods("ml").Get(f.ctx, ref.Name, metav1.GetOptions{}); err == nil {
				gone = false
			}
		}
		if gone {
			if err := f.client.ResourceV1().ResourceClaims("ml").Delete(f.ctx, c.Name, metav1.DeleteOptions{}); err != nil {
				f.t.Fatal(err)
			}
		}
	}
}

// reconcileOK reconciles gang ml/<name> and fails on an error.
func (f *fakeCluster) reconcileOK(name string) *gangv1.Gang {
	f.t.Helper()
	if _, err := f.reconcile("ml", name); err != nil {
		f.t.Fatalf("reconcile %s: %v", name, err)
	}
	return f.gang("ml", name)
}

func waitingReason(g *gangv1.Gang) string {
	if c := meta.FindStatusCondition(g.Status.Conditions, gangv1.ConditionWaiting); c != nil && c.Status == metav1.ConditionTrue {
		return c.Reason
	}
	return ""
}

// preemptionCluster has a low-priority gang (100) of two 2-GPU members
// running on tray a1, the whole of the one-tray clique 1, and a pod of
// priority 500 on each tray of clique 2 holding all four of its GPUs.
func preemptionCluster(t *testing.T, lowEdit func(*v1.Pod)) *fakeCluster {
	snap, nodes := trays(t, map[string]uint32{"a1": 1, "b1": 2, "b2": 2})
	f := newFakeCluster(t, snap, nodes)
	f.prioGang("low", 2, 2, 100, lowEdit)
	if g := f.reconcileOK("low"); g.Annotations[gangv1.AnnotationCommitted] == "" || !strings.HasPrefix(g.Status.Domain, poolOf(1)) {
		t.Fatalf("low gang not placed in clique 1: %s", g.Status.Domain)
	}
	f.runReleased("low-0", "low-1")
	f.runningPod("mid-b1", "b1", 4, 500)
	f.runningPod("mid-b2", "b2", 4, 500)
	f.drainEvents()
	return f
}

// A gang that fits nowhere frees the domain whose victims cost least (the
// lowest priority first, then the fewest pods): here the whole low gang in
// clique 1, though one of its members would free enough GPUs, rather than
// one pod of priority 500 in clique 2. It evicts nothing more while they
// end, a gang of lower priority is not placed in the domain meanwhile, and
// the gang is placed there once the devices are free.
func TestAGangPreemptsTheCheapestWholeUnitInOneDomain(t *testing.T) {
	f := preemptionCluster(t, nil)
	f.prioGang("high", 2, 1, 1000, nil)
	g := f.reconcileOK("high")
	if want := []string{"low-1", "low-0"}; !slices.Equal(f.evicted, want) {
		t.Fatalf("evicted %v, want the whole low gang, workers by rank from the last: %v", f.evicted, want)
	}
	pre := g.Status.Preemption
	if waitingReason(g) != gangv1.ReasonPreempting || pre == nil || pre.Domain != poolOf(1) || pre.Priority != 1000 || !slices.Equal(pre.Victims, []string{"ml/low-0", "ml/low-1"}) {
		t.Fatalf("status after preempting: waiting %q, preemption %+v", waitingReason(g), pre)
	}
	events := strings.Join(f.drainEvents(), "\n")
	if !strings.Contains(events, gangv1.ReasonPreempting+" preempting 2 pods of lower priority in "+poolOf(1)) || strings.Count(events, gangv1.ReasonPreempted+" preempted by gang ml/high (priority 1000)") != 2 {
		t.Errorf("events:\n%s", events)
	}

	// The victims are gone but their claims not freed yet: nothing more is
	// evicted, the gang keeps the domain.
	g = f.reconcileOK("high")
	if len(f.evicted) != 2 || waitingReason(g) != gangv1.ReasonPreempting || g.Status.Preemption == nil || g.Status.Preemption.Domain != poolOf(1) {
		t.Fatalf("second look: evicted %v, waiting %q, preemption %+v", f.evicted, waitingReason(g), g.Status.Preemption)
	}

	// A gang of lower priority that fits there once the claims are freed is
	// kept out of the held domain.
	f.prioGang("other", 1, 1, 50, nil)
	f.freeClaimsOfGonePods()
	other := f.reconcileOK("other")
	if waitingReason(other) != gangv1.ReasonNoDomainFits || !strings.Contains(conditionMessage(&other.Status, gangv1.ConditionWaiting), "held for gang ml/high (priority 1000)") {
		t.Fatalf("lower gang while the domain is held: waiting %q: %s", waitingReason(other), conditionMessage(&other.Status, gangv1.ConditionWaiting))
	}
	if other.Status.Preemption != nil || len(f.evicted) != 2 {
		t.Fatalf("the lower gang preempted: %+v, evicted %v", other.Status.Preemption, f.evicted)
	}

	g = f.reconcileOK("high")
	if g.Annotations[gangv1.AnnotationCommitted] == "" || !strings.HasPrefix(g.Status.Domain, poolOf(1)) || g.Status.Preemption != nil {
		t.Fatalf("high gang not placed in the freed clique: domain %q, preemption %+v\n%+v", g.Status.Domain, g.Status.Preemption, g.Status.Conditions)
	}
	if other = f.reconcileOK("other"); other.Annotations[gangv1.AnnotationCommitted] == "" {
		t.Fatalf("lower gang not placed once the higher one is: %+v", other.Status.Conditions)
	}
	for _, name := range []string{"mid-b1", "mid-b2"} {
		f.pod("ml", name)
	}
}

// A gang never preempts pods of its own priority or above, nor when a
// member says preemptionPolicy Never, nor a unit that a
// PodDisruptionBudget would not let go whole (it takes the next cheapest).
func TestAGangPreemptsOnlyWhatItMay(t *testing.T) {
	never := func(p *v1.Pod) { p.Spec.PreemptionPolicy = ptr.To(v1.PreemptNever) }
	for _, tc := range []struct {
		name     string
		high     int32
		highEdit func(*v1.Pod)
		budget   int32 // disruptions the low gang's budget allows; -1: none
		everyPod bool  // the budget's selector is empty: it covers every pod of the namespace
		evicted  []string
		domain   string
	}{
		{name: "pods of equal or higher priority only", high: 100, budget: -1},
		{name: "preemptionPolicy Never", high: 1000, highEdit: never, budget: -1},
		{name: "a budget keeps the low gang", high: 1000, budget: 1, evicted: []string{"mid-b1"}, domain: poolOf(2)},
		{name: "a budget that allows the whole gang", high: 1000, budget: 2, evicted: []string{"low-1", "low-0"}, domain: poolOf(1)},
		{name: "an empty selector covers every pod", high: 1000, budget: 1, everyPod: true, evicted: []string{"mid-b1"}, domain: poolOf(2)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := preemptionCluster(t, nil)
			if tc.high == 100 {
				// Everything else runs at 100 or above.
				for _, name := range []string{"mid-b1", "mid-b2"} {
					p := f.pod("ml", name)
					p.Spec.Priority = ptr.To[int32](100)
					if err := f.client.Tracker().Update(v1.SchemeGroupVersion.WithResource("pods"), p, "ml"); err != nil {
						t.Fatal(err)
					}
				}
			}
			if tc.budget >= 0 {
				sel := &metav1.LabelSelector{MatchLabels: map[string]string{"gang": "low"}}
				if tc.everyPod {
					sel = &metav1.LabelSelector{}
				}
				f.create(&policyv1.PodDisruptionBudget{
					ObjectMeta: metav1.ObjectMeta{Name: "low", Namespace: "ml"},
					Spec:       policyv1.PodDisruptionBudgetSpec{Selector: sel},
					Status:     policyv1.PodDisruptionBudgetStatus{DisruptionsAllowed: tc.budget},
				})
			}
			f.prioGang("high", 2, 1, tc.high, tc.highEdit)
			g := f.reconcileOK("high")
			if !slices.Equal(f.evicted, tc.evicted) {
				t.Fatalf("evicted %v, want %v", f.evicted, tc.evicted)
			}
			if tc.domain == "" {
				if waitingReason(g) != gangv1.ReasonNoDomainFits || g.Status.Preemption != nil {
					t.Fatalf("waiting %q, preemption %+v; want %s and none", waitingReason(g), g.Status.Preemption, gangv1.ReasonNoDomainFits)
				}
				return
			}
			if waitingReason(g) != gangv1.ReasonPreempting || g.Status.Preemption == nil || g.Status.Preemption.Domain != tc.domain {
				t.Fatalf("waiting %q, preemption %+v; want %s in %s", waitingReason(g), g.Status.Preemption, gangv1.ReasonPreempting, tc.domain)
			}
		})
	}
}
