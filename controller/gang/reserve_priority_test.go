package gang

import (
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/utils/ptr"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/driver/simulate"
)

// priorityCluster: tray a1 (clique 1, alone) is full of a pod expected to
// run two hours; in clique 2, tray b1 holds a pod of two GPUs whose deadline
// ends in ten minutes, and tray b2 one of four GPUs whose deadline ends in
// twenty. Gang big (priority 0, two members of four GPUs each) can start
// only once both have ended: it reserves b1 and b2, and with them the two
// GPUs of b1 that are free now.
func priorityCluster(t *testing.T) *fakeCluster {
	t.Helper()
	return priorityClusterWith(t, nil, nil)
}

// priorityClusterWith is priorityCluster with more trays (name -> clique),
// and setup run before gang big reserves.
func priorityClusterWith(t *testing.T, more map[string]uint32, setup func(*fakeCluster)) *fakeCluster {
	t.Helper()
	cliques := map[string]uint32{"a1": 1, "b1": 2, "b2": 2}
	maps.Copy(cliques, more)
	snap, nodes := trays(t, cliques)
	f := newFakeCluster(t, snap, nodes)
	if setup != nil {
		setup(f)
	}
	f.runningPod("long-a1", "a1", 4, 0, startedAgo(time.Minute), expectedRuntime("2h"))
	f.runningPod("short-b1", "b1", 2, 0, startedAgo(time.Minute), deadline(11*time.Minute))
	f.runningPod("short-b2", "b2", 4, 0, startedAgo(time.Minute), deadline(21*time.Minute))
	f.prioGang("big", 2, 4, 0, nil)
	if r := f.reconcileOK("big").Status.Reservation; r == nil || !slices.Equal(r.Nodes, []string{"b1", "b2"}) {
		t.Fatalf("gang big: reservation %+v, want trays b1 and b2", r)
	}
	if pools := f.reservedPools("big"); !slices.Equal(pools, []string{"b1", "b2"}) {
		t.Fatalf("gang big taints pools %v, want b1 and b2", pools)
	}
	return f
}

// reservedPools are the pools gang ml/<name>'s reservation rules taint, as
// the API server has them, sorted.
func (f *fakeCluster) reservedPools(name string) []string {
	f.t.Helper()
	uid := string(f.gang("ml", name).UID)
	var pools []string
	for _, r := range f.taintRules() {
		if r.Labels[gangv1.LabelReservation] == uid && r.Spec.DeviceSelector != nil {
			pools = append(pools, ptr.Deref(r.Spec.DeviceSelector.Pool, ""))
		}
	}
	slices.Sort(pools)
	return pools
}

// schedulerAllocates says whether the scheduler's allocator, over the
// devices as the scheduler sees them now (every DeviceTaintRule applied,
// the controller's reservations included), allocates claim ml/<claim> on
// node; why not, when it does not.
func (f *fakeCluster) schedulerAllocates(claim, node string) (bool, string) {
	f.t.Helper()
	c := f.claim("ml", claim)
	res, snap, err := f.allocateAsScheduler(c, node)
	if err != nil || len(res) != 1 {
		return false, "does not fit beside " + strings.Join(simulate.Untolerated(snap.Slices, snap.Rules, c.Spec.Devices.Requests[0].Exactly.Tolerations), ", ")
	}
	return true, ""
}

// allocateAsScheduler allocates claim c on node with the scheduler's
// allocator over the devices as the scheduler sees them now (every
// DeviceTaintRule applied), writing nothing; it returns the snapshot it
// judged on.
func (f *fakeCluster) allocateAsScheduler(c *resourceapi.ResourceClaim, node string) ([]resourceapi.AllocationResult, *simulate.Snapshot, error) {
	f.t.Helper()
	snap, err := simulate.List(f.ctx, f.client, nil)
	if err != nil {
		f.t.Fatal(err)
	}
	n, err := f.client.CoreV1().Nodes().Get(f.ctx, node, metav1.GetOptions{})
	if err != nil {
		f.t.Fatal(err)
	}
	res, err := snap.Cluster(nil, nil).AllocateOnNode(f.ctx, n, c)
	return res, snap, err
}

// pendingPod creates pod ml/<name> of priority that the scheduler could not
// place (PodScheduled False, Unschedulable), with an unallocated claim
// <name>-gpu of gpus GPUs.
func (f *fakeCluster) pendingPod(name string, gpus int64, priority int32) {
	f.t.Helper()
	pod := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ml", UID: types.UID("uid-pod-" + name), CreationTimestamp: metav1.Now()},
		Spec: v1.PodSpec{Priority: ptr.To(priority),
			ResourceClaims: []v1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: ptr.To("gpus")}}},
		Status: v1.PodStatus{Phase: v1.PodPending,
			Conditions:            []v1.PodCondition{{Type: v1.PodScheduled, Status: v1.ConditionFalse, Reason: v1.PodReasonUnschedulable}},
			ResourceClaimStatuses: []v1.PodResourceClaimStatus{{Name: "gpu", ResourceClaimName: ptr.To(name + "-gpu")}}},
	}
	f.create(pod, newClaim(name+"-gpu", "gpu.tessera.dev", gpus))
}

// A reservation holds devices only against gangs and pods of lower or
// equal priority. A gang of higher priority that fits on a reserved tray
// is placed there (the reservation does not keep it out of the domain),
// and the reservation's rule on that tray goes before its members reach
// the scheduler, so that the scheduler allocates them there; the reserving
// gang's next looks do not taint the tray again while a released member
// waits for its allocation. The same holds when the controller is killed
// after the commit, before the release: the next look deletes the rule
// before it releases the members.
func TestAReservationYieldsToAGangOfHigherPriority(t *testing.T) {
	for _, tc := range []struct {
		name  string
		crash bool
	}{
		{"released at once", false},
		{"the controller killed after the commit, before the release", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := priorityCluster(t)
			f.prioGang("high", 1, 2, 100, nil)
			if tc.crash {
				f.r.interrupt = func(step string) bool { return step == StepRelease }
				if _, err := f.reconcile("ml", "high"); err == nil {
					t.Fatal("the placement was not interrupted at the release")
				}
				f.r.interrupt = nil
				if p := f.pod("ml", "high-0"); !hasGate(p) {
					t.Fatal("high-0 released before the crash")
				}
			}
			g := f.reconcileOK("high")
			p := f.pod("ml", "high-0")
			if g.Annotations[gangv1.AnnotationCommitted] == "" || hasGate(p) || pinnedTo(p) != "b1" {
				t.Fatalf("gang high: committed %q, gated %v, pinned to %q; want it placed on b1's free GPUs", g.Annotations[gangv1.AnnotationCommitted], hasGate(p), pinnedTo(p))
			}
			if pools := f.reservedPools("big"); !slices.Equal(pools, []string{"b2"}) {
				t.Errorf("gang big taints pools %v once gang high (priority 100) is released onto b1, want b2 only", pools)
			}
			if ok, why := f.schedulerAllocates("high-0-gpu", "b1"); !ok {
				t.Fatalf("the scheduler cannot allocate gang high's member on b1, where it was placed: %s", why)
			}
			// The reserving gang looks again before the scheduler has
			// allocated the member: it does not taint b1 again.
			f.reconcileOK("big")
			if pools := f.reservedPools("big"); slices.Contains(pools, "b1") {
				t.Errorf("gang big taints pools %v while gang high's member waits for its allocation on b1", pools)
			}
			if ok, why := f.schedulerAllocates("high-0-gpu", "b1"); !ok {
				t.Fatalf("after gang big's next look, the scheduler cannot allocate gang high's member on b1: %s", why)
			}
			f.allocateReleased("high-0")
		})
	}
}

// A pod of higher priority than a reservation's gang that the scheduler
// could not place, and whose claims fit on a reserved tray once the
// reservation is gone, is given that tray: the reservation's rule leaves
// it, and the scheduler allocates the pod there. A pod of the gang's own
// priority is held off like any other.
func TestAReservationYieldsATrayToAPodOfHigherPriority(t *testing.T) {
	for _, tc := range []struct {
		name     string
		priority int32
		yield    bool
	}{
		{"priority 100, above the gang's", 100, true},
		{"priority 0, the gang's", 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := priorityCluster(t)
			f.pendingPod("urgent", 2, tc.priority)
			g := f.reconcileOK("big")
			want := []string{"b1", "b2"}
			if tc.yield {
				want = []string{"b2"}
			}
			if pools := f.reservedPools("big"); !slices.Equal(pools, want) {
				t.Errorf("gang big taints pools %v with a pod of priority %d pending, want %v", pools, tc.priority, want)
			}
			if ok, why := f.schedulerAllocates("urgent-gpu", "b1"); ok != tc.yield {
				t.Errorf("the scheduler allocates the pending pod of priority %d on b1: %v (%s), want %v", tc.priority, ok, why, tc.yield)
			}
			msg := conditionMessage(&g.Status, gangv1.ConditionWaiting)
			if tc.yield != strings.Contains(msg, "left b1 to ml/urgent") {
				t.Errorf("waiting: %s", msg)
			}
			if len(f.evicted) != 0 {
				t.Errorf("evicted %v", f.evicted)
			}
		})
	}
}

// A pod that the scheduler could not place queues the gangs whose
// reservations are of lower priority than it (they may have to leave it a
// node), and no other gang; a reservation gone takes its gang off the list.
func TestAnUnschedulablePodOfHigherPriorityQueuesTheReservationsBelowIt(t *testing.T) {
	c := &Controller{
		queue:     workqueue.NewTypedRateLimitingQueue(workqueue.DefaultTypedControllerRateLimiter[string]()),
		members:   map[string]gangv1.Members{},
		reserving: map[string]reserving{},
	}
	defer c.queue.ShutDown()
	for _, g := range []struct {
		name     string
		priority int32
	}{{"low", 0}, {"high", 1000}} {
		gang := labelGangOf(g.name, 2, g.name+"-domain")
		gang.Status.Reservation = &gangv1.Reservation{Domain: "d", Priority: g.priority}
		u, err := toUnstructured(gang)
		if err != nil {
			t.Fatal(err)
		}
		c.gangChanged(u)
	}
	for c.queue.Len() > 0 {
		k, _ := c.queue.Get()
		c.queue.Done(k)
	}
	queued := func() []string {
		var keys []string
		for c.queue.Len() > 0 {
			k, _ := c.queue.Get()
			c.queue.Done(k)
			keys = append(keys, k)
		}
		slices.Sort(keys)
		return keys
	}
	pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "urgent", Namespace: "other"}, Spec: v1.PodSpec{Priority: ptr.To[int32](100)},
		Status: v1.PodStatus{Conditions: []v1.PodCondition{{Type: v1.PodScheduled, Status: v1.ConditionFalse, Reason: v1.PodReasonUnschedulable}}}}
	c.podChanged(pod)
	if got := queued(); !slices.Equal(got, []string{"ml/low"}) {
		t.Errorf("queued %v for an unschedulable pod of priority 100, want ml/low", got)
	}
	pod.Status.Conditions[0].Reason = v1.PodReasonSchedulingGated
	c.podChanged(pod)
	if got := queued(); len(got) != 0 {
		t.Errorf("queued %v for a gated pod", got)
	}
	low := labelGangOf("low", 2, "low-domain")
	u, err := toUnstructured(low)
	if err != nil {
		t.Fatal(err)
	}
	c.gangChanged(u)
	queued()
	pod.Status.Conditions[0].Reason = v1.PodReasonUnschedulable
	c.podChanged(pod)
	if got := queued(); len(got) != 0 {
		t.Errorf("queued %v once gang low holds no reservation", got)
	}
}

// asExtended makes a pending pod ask its two GPUs as the extended resource
// name, in its container's limits (the API server copies them to requests),
// instead of through a claim.
func asExtended(name v1.ResourceName) func(*v1.Pod) {
	return func(p *v1.Pod) {
		p.Spec.ResourceClaims = nil
		p.Spec.Containers = []v1.Container{{Name: "c", Resources: v1.ResourceRequirements{Limits: v1.ResourceList{name: resource.MustParse("2")}}}}
	}
}

// A reservation leaves a node only to a pod it keeps out: a pending pod of
// higher priority that fits on a tray no reservation holds (tray c1, of a
// clique of its own, free) is unschedulable for another reason (here a
// host port, which the controller does not model) and gets nothing; nor
// does one whose node selector matches no node, or that asks more CPU than
// any node has. Once c1 is full, the reservation is what keeps the pod out,
// and it is given b1, also when it asks its GPUs as the DeviceClass's
// extended resource (no claims of its own).
func TestAReservationYieldsOnlyToAPodItKeepsOut(t *testing.T) {
	for _, tc := range []struct {
		name   string
		c1Full bool
		edit   func(*v1.Pod)
		yield  bool
	}{
		{name: "fits on a free tray no reservation holds", edit: func(p *v1.Pod) {
			p.Status.Conditions[0].Message = "0/4 nodes are available: 1 node(s) didn't have free ports for the requested pod ports."
		}},
		{name: "a node selector no node matches", c1Full: true, edit: func(p *v1.Pod) { p.Spec.NodeSelector = map[string]string{"pool": "nowhere"} }},
		{name: "more CPU than any node has", c1Full: true, edit: func(p *v1.Pod) {
			p.Spec.Containers = []v1.Container{{Name: "c", Resources: v1.ResourceRequirements{Requests: v1.ResourceList{v1.ResourceCPU: resource.MustParse("100")}}}}
		}},
		{name: "kept out by the reservation alone", c1Full: true, yield: true},
		// The README's way of asking: the DeviceClass's extended resource,
		// with no claims in the pod (the scheduler makes one).
		{name: "asking GPUs as the class's extended resource, kept out", c1Full: true, yield: true, edit: asExtended("gpu.tessera.dev/gpu")},
		{name: "asking GPUs by the class's implicit resource name, kept out", c1Full: true, yield: true, edit: asExtended("deviceclass.resource.kubernetes.io/gpu.tessera.dev")},
		{name: "asking GPUs as an extended resource, fits on a free tray", edit: asExtended("gpu.tessera.dev/gpu")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := priorityClusterWith(t, map[string]uint32{"c1": 3}, func(f *fakeCluster) {
				if tc.c1Full {
					f.runningPod("forever-c1", "c1", 4, 0)
				}
			})
			f.pendingPod("urgent", 2, 100)
			if tc.edit != nil {
				p := f.pod("ml", "urgent")
				tc.edit(p)
				if err := f.client.Tracker().Update(v1.SchemeGroupVersion.WithResource("pods"), p, "ml"); err != nil {
					t.Fatal(err)
				}
			}
			g := f.reconcileOK("big")
			want := []string{"b1", "b2"}
			if tc.yield {
				want = []string{"b2"}
			}
			if pools := f.reservedPools("big"); !slices.Equal(pools, want) {
				t.Errorf("gang big taints pools %v, want %v", pools, want)
			}
			if msg := conditionMessage(&g.Status, gangv1.ConditionWaiting); tc.yield != strings.Contains(msg, "left b1 to ml/urgent") {
				t.Errorf("waiting: %s", msg)
			}
		})
	}
}
