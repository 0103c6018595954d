package gang

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/utils/ptr"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
)

// pendingPodEnding is pendingPod with an activeDeadlineSeconds of five
// minutes, so that a reservation counts on it ending once it runs.
func (f *fakeCluster) pendingPodEnding(name string, gpus int64, priority int32) {
	f.t.Helper()
	f.pendingPod(name, gpus, priority)
	p := f.pod("ml", name)
	p.Spec.ActiveDeadlineSeconds = ptr.To[int64](300)
	if err := f.client.Tracker().Update(v1.SchemeGroupVersion.WithResource("pods"), p, "ml"); err != nil {
		f.t.Fatal(err)
	}
}

// schedule does what the scheduler and the kubelet do with pending pod
// ml/<name> on node: its claims allocated there by the scheduler's
// allocator over the devices as the scheduler sees them (every
// DeviceTaintRule applied), the pod bound and running.
func (f *fakeCluster) schedule(name, node string) {
	f.t.Helper()
	p := f.pod("ml", name)
	c := f.claim("ml", name+"-gpu")
	res, _, err := f.allocateAsScheduler(c, node)
	if err != nil || len(res) != 1 {
		f.t.Fatalf("the scheduler cannot allocate %s on %s: %v %v", c.Name, node, res, err)
	}
	c.Status.Allocation = &res[0]
	c.Status.ReservedFor = []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: name, UID: p.UID}}
	if _, err := f.client.ResourceV1().ResourceClaims("ml").UpdateStatus(f.ctx, c, metav1.UpdateOptions{}); err != nil {
		f.t.Fatal(err)
	}
	p.Spec.NodeName = node
	p.Status.Phase = v1.PodRunning
	p.Status.StartTime = ptr.To(metav1.Now())
	p.Status.Conditions = []v1.PodCondition{{Type: v1.PodScheduled, Status: v1.ConditionTrue, LastTransitionTime: metav1.Now()}}
	if err := f.client.Tracker().Update(v1.SchemeGroupVersion.WithResource("pods"), p, "ml"); err != nil {
		f.t.Fatal(err)
	}
}

// end deletes pod ml/<name> and frees its claims, as its end does.
func (f *fakeCluster) end(name string) {
	f.t.Helper()
	if err := f.client.CoreV1().Pods("ml").Delete(f.ctx, name, metav1.DeleteOptions{}); err != nil {
		f.t.Fatal(err)
	}
	f.freeClaimsOfGonePods()
}

// watchingController is a controller that only queues: it has seen gang
// ml/<gang> as it is now.
func (f *fakeCluster) watchingController(gang string) *Controller {
	f.t.Helper()
	c := &Controller{
		queue:     workqueue.NewTypedRateLimitingQueue(workqueue.DefaultTypedControllerRateLimiter[string]()),
		members:   map[string]gangv1.Members{},
		reserving: map[string]reserving{},
	}
	f.t.Cleanup(c.queue.ShutDown)
	u, err := toUnstructured(f.gang("ml", gang))
	if err != nil {
		f.t.Fatal(err)
	}
	c.gangChanged(u)
	for c.queue.Len() > 0 {
		k, _ := c.queue.Get()
		c.queue.Done(k)
	}
	return c
}

// After a reservation left a node to a pod of higher priority, the pod's
// placement queues the reserving gang, and its next look reserves the node
// again, around the devices the pod took (it waits for the pod's end like
// any other's); until then the look that yielded asks to be looked at
// again within the yield's minute.
func TestAReservationIsRecomputedAroundAPodItYieldedTo(t *testing.T) {
	f := priorityCluster(t)
	first := f.gang("ml", "big").Status.Reservation
	f.pendingPodEnding("urgent", 2, 100)
	res, err := f.reconcile("ml", "big")
	if err != nil {
		t.Fatal(err)
	}
	g := f.gang("ml", "big")
	if pools := f.reservedPools("big"); !slices.Equal(pools, []string{"b2"}) {
		t.Fatalf("gang big taints pools %v with ml/urgent pending, want b2", pools)
	}
	if y := g.Status.Reservation.Yields; len(y) != 1 || y[0].Pod != "ml/urgent" || y[0].Node != "b1" {
		t.Errorf("yields %+v, want b1 to ml/urgent", y)
	}
	if res.requeueAfter <= 0 || res.requeueAfter > time.Minute {
		t.Errorf("next look in %v, want within the yield's minute", res.requeueAfter)
	}
	c := f.watchingController("big")
	f.schedule("urgent", "b1")
	c.podChanged(f.pod("ml", "urgent"))
	if c.queue.Len() != 1 {
		t.Fatalf("the yielded pod's placement queued %d gangs, want gang big", c.queue.Len())
	}
	g = f.reconcileOK("big")
	r := g.Status.Reservation
	if pools := f.reservedPools("big"); !slices.Equal(pools, []string{"b1", "b2"}) {
		t.Errorf("gang big taints pools %v once ml/urgent runs on b1, want b1 and b2", pools)
	}
	if r == nil || !slices.Equal(r.Nodes, []string{"b1", "b2"}) || !slices.Contains(r.WaitingFor, "ml/urgent") || !r.Start.Equal(&first.Start) {
		t.Errorf("reservation %+v, want b1 and b2 from %v, waiting for ml/urgent too", r, first.Start)
	}
	if len(f.evicted) != 0 {
		t.Errorf("evicted %v", f.evicted)
	}
}

// A reservation leaves nodes to at most MaxReservationYields pods over its
// life: a stream of pods of higher priority, each placed on the node left
// to it and ending, gets b1 four times; the fifth waits, and b1 stays
// reserved.
func TestAReservationLeavesNodesToABoundedNumberOfPods(t *testing.T) {
	f := priorityCluster(t)
	for i := range gangv1.MaxReservationYields + 1 {
		name := fmt.Sprintf("urgent-%d", i)
		f.pendingPodEnding(name, 1, 100)
		g := f.reconcileOK("big")
		msg := conditionMessage(&g.Status, gangv1.ConditionWaiting)
		if i == gangv1.MaxReservationYields {
			if pools := f.reservedPools("big"); !slices.Equal(pools, []string{"b1", "b2"}) || !strings.Contains(msg, "left no node to ml/"+name) {
				t.Fatalf("pod %d: gang big taints pools %v; %s; want b1 kept", i, pools, msg)
			}
			if n := len(g.Status.Reservation.Yields); n != gangv1.MaxReservationYields {
				t.Errorf("%d yields recorded, want %d", n, gangv1.MaxReservationYields)
			}
			break
		}
		if pools := f.reservedPools("big"); !slices.Equal(pools, []string{"b2"}) || !strings.Contains(msg, "left b1 to ml/"+name) {
			t.Fatalf("pod %d: gang big taints pools %v; %s; want b1 left to it", i, pools, msg)
		}
		f.schedule(name, "b1")
		f.reconcileOK("big")
		if pools := f.reservedPools("big"); !slices.Equal(pools, []string{"b1", "b2"}) {
			t.Fatalf("pod %d placed: gang big taints pools %v, want b1 again", i, pools)
		}
		f.end(name)
	}
}

// A node left to a pod stays left for a minute while the pod is not
// placed: a pod the scheduler still does not place then (something else
// keeps it out) has the node reserved again, and is not given it anew.
func TestAYieldEndsWhenItsPodIsNotPlacedWithinAMinute(t *testing.T) {
	f := priorityCluster(t)
	f.pendingPod("urgent", 2, 100)
	g := f.reconcileOK("big")
	if pools := f.reservedPools("big"); !slices.Equal(pools, []string{"b2"}) || len(g.Status.Reservation.Yields) != 1 {
		t.Fatalf("gang big taints pools %v, yields %+v; want b1 left to ml/urgent", pools, g.Status.Reservation.Yields)
	}
	g.Status.Reservation.Yields[0].At = metav1.NewTime(time.Now().Add(-61 * time.Second))
	if _, err := f.r.gangs.UpdateStatus(f.ctx, g); err != nil {
		t.Fatal(err)
	}
	g = f.reconcileOK("big")
	if pools := f.reservedPools("big"); !slices.Equal(pools, []string{"b1", "b2"}) {
		t.Errorf("a minute after the yield, ml/urgent still pending: gang big taints pools %v, want b1 again", pools)
	}
	if msg := conditionMessage(&g.Status, gangv1.ConditionWaiting); !strings.Contains(msg, "left no node to ml/urgent (not placed within") {
		t.Errorf("waiting: %s", msg)
	}
}
