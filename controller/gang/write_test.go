package gang

import (
	"fmt"
	"strings"
	"sync/atomic"
	"testing"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/klog/v2/ktesting"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/deviceclass"
	"github.com/tessera-dev/tessera/driver/discovery"
	"github.com/tessera-dev/tessera/driver/inventory"
	"github.com/tessera-dev/tessera/driver/simulate"
	"github.com/tessera-dev/tessera/test/fixtures"
)

// sharedTray is a GB200 tray "n1" whose GPUs 0 and 1 offer MIG partitions
// beside the whole GPU (shared counters), GPU 2 is cut into two time slices
// and GPU 3 is shared by memory (185 GiB).
func sharedTray(t *testing.T) (*simulate.Snapshot, map[string]*v1.Node) {
	t.Helper()
	classes, err := deviceclass.All()
	if err != nil {
		t.Fatal(err)
	}
	sl := fixtures.Slices(t, fixtures.Profile(t, "gb200-nvl72-tray"), "n1", inventory.Options{DynamicMIG: true, Sharing: func(g discovery.GPU) inventory.Share {
		switch g.Index {
		case 2:
			return inventory.Share{TimeSlices: 2}
		case 3:
			return inventory.Share{Memory: true}
		}
		return inventory.Share{}
	}})
	node := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1", Labels: map[string]string{"kubernetes.io/hostname": "n1"}}}
	return &simulate.Snapshot{Classes: classes, Slices: sl}, map[string]*v1.Node{"n1": node}
}

// held is a claim on n1 allocated device (a share of it when capacity is
// set: "timeSlices=2", "memory=100Gi"), asking for it through class.
func held(name, class, device string, capacity ...string) *resourceapi.ResourceClaim {
	c := newClaim(name, class, 1)
	r := resourceapi.DeviceRequestAllocationResult{Request: "r", Driver: driver, Pool: "n1", Device: device}
	if len(capacity) > 0 {
		share := types.UID("share-" + name)
		r.ShareID = &share
		r.ConsumedCapacity = map[resourceapi.QualifiedName]resource.Quantity{}
		c.Spec.Devices.Requests[0].Exactly.Capacity = &resourceapi.CapacityRequirements{Requests: map[resourceapi.QualifiedName]resource.Quantity{}}
		for _, kv := range capacity {
			k, val, _ := strings.Cut(kv, "=")
			r.ConsumedCapacity[resourceapi.QualifiedName(k)] = resource.MustParse(val)
			c.Spec.Devices.Requests[0].Exactly.Capacity.Requests[resourceapi.QualifiedName(k)] = resource.MustParse(val)
		}
	}
	c.Status.Allocation = &resourceapi.AllocationResult{
		Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{r}},
		NodeSelector: &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{{MatchFields: []v1.NodeSelectorRequirement{
			{Key: "metadata.name", Operator: v1.NodeSelectorOpIn, Values: []string{"n1"}},
		}}}},
	}
	return c
}

// The post-write re-check judges the gang's claims as the scheduler's
// allocator would: not only the same device held twice, but a partition
// of a whole GPU the gang got, and more time slices or memory of a shared
// GPU than it has.
func TestTheReCheckFindsEveryConflictTheAllocatorWouldRefuse(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	snap, nodes := sharedTray(t)
	for _, tc := range []struct {
		name  string
		rival *resourceapi.ResourceClaim
		gang  *resourceapi.ResourceClaim
		// conflict is a part of the message; "" when the gang fits.
		conflict string
	}{{
		name:     "the same whole GPU",
		rival:    held("rival", "gpu.tessera.dev", "gpu-0"),
		gang:     held("member", "gpu.tessera.dev", "gpu-0"),
		conflict: "claim ml/rival (n1/gpu-0)",
	}, {
		name:     "a partition of the gang's whole GPU",
		rival:    held("rival", "mig.gpu.tessera.dev", "gpu-0-mig-1g23gb-6"),
		gang:     held("member", "gpu.tessera.dev", "gpu-0"),
		conflict: "claim ml/rival (n1/gpu-0-mig-1g23gb-6)",
	}, {
		name:  "a partition of another GPU",
		rival: held("rival", "mig.gpu.tessera.dev", "gpu-1-mig-1g23gb-6"),
		gang:  held("member", "gpu.tessera.dev", "gpu-0"),
	}, {
		name:     "a third time slice of a GPU cut in two",
		rival:    held("rival", "timeslice.gpu.tessera.dev", "gpu-2", "timeSlices=2"),
		gang:     held("member", "timeslice.gpu.tessera.dev", "gpu-2", "timeSlices=1"),
		conflict: "claim ml/rival (n1/gpu-2)",
	}, {
		name:  "the second time slice",
		rival: held("rival", "timeslice.gpu.tessera.dev", "gpu-2", "timeSlices=1"),
		gang:  held("member", "timeslice.gpu.tessera.dev", "gpu-2", "timeSlices=1"),
	}, {
		name:     "memory shares beyond the GPU's memory",
		rival:    held("rival", "memory.gpu.tessera.dev", "gpu-3", "memory=100Gi"),
		gang:     held("member", "memory.gpu.tessera.dev", "gpu-3", "memory=100Gi"),
		conflict: "claim ml/rival (n1/gpu-3)",
	}, {
		name:  "memory shares that fit",
		rival: held("rival", "memory.gpu.tessera.dev", "gpu-3", "memory=85Gi"),
		gang:  held("member", "memory.gpu.tessera.dev", "gpu-3", "memory=100Gi"),
	}} {
		t.Run(tc.name, func(t *testing.T) {
			client := fake.NewClientset(tc.rival, tc.gang)
			got, err := conflicts(ctx, client, snap, nodes, []*resourceapi.ResourceClaim{tc.gang})
			if err != nil {
				t.Fatal(err)
			}
			switch {
			case tc.conflict == "" && got != "":
				t.Errorf("conflict %q, want none: the gang's claim fits beside the rival", got)
			case tc.conflict != "" && !strings.Contains(got, tc.conflict):
				t.Errorf("conflict %q, want one naming %s", got, tc.conflict)
			case tc.conflict != "" && !strings.Contains(got, "claim ml/member"):
				t.Errorf("conflict %q does not name the gang's claim ml/member", got)
			}
		})
	}
	// A request with alternatives is judged by the one chosen.
	rival, member := held("rival", "mig.gpu.tessera.dev", "gpu-0-mig-1g23gb-6"), held("member", "gpu.tessera.dev", "gpu-0")
	member.Spec.Devices.Requests[0] = resourceapi.DeviceRequest{Name: "r", FirstAvailable: []resourceapi.DeviceSubRequest{
		{Name: "whole", DeviceClassName: "gpu.tessera.dev", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1},
		{Name: "part", DeviceClassName: "mig.gpu.tessera.dev", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1},
	}}
	member.Status.Allocation.Devices.Results[0].Request = "r/whole"
	if got, err := conflicts(ctx, fake.NewClientset(rival, member), snap, nodes, []*resourceapi.ResourceClaim{member}); err != nil || !strings.Contains(got, "claim ml/rival") {
		t.Errorf("a prioritized list's whole GPU beside a partition of it: conflict %q (%v), want claim ml/rival named", got, err)
	}
	// The gang's own claims are judged beside each other too.
	client := fake.NewClientset()
	a, b := held("a", "memory.gpu.tessera.dev", "gpu-3", "memory=100Gi"), held("b", "memory.gpu.tessera.dev", "gpu-3", "memory=100Gi")
	if got, err := conflicts(ctx, client, snap, nodes, []*resourceapi.ResourceClaim{a, b}); err != nil || !strings.Contains(got, "claim ml/b") {
		t.Errorf("two members' 100 GiB shares of one 185 GiB GPU: conflict %q (%v), want claim ml/b named", got, err)
	}
}

// A claim the scheduler allocates while the controller searches (after its
// snapshot, before its writes) is seen before anything is written: the
// controller writes no double allocation it could have known of. One it
// writes is rolled back, but the scheduler counts each allocated device
// once, so clearing one of two claims that hold a device makes it forget
// the other's hold and hand the device out again.
func TestAClaimAllocatedDuringTheSearchIsSeenBeforeAnyWrite(t *testing.T) {
	snap, nodes := trays(t, map[string]uint32{"a1": 1})
	f := newFakeCluster(t, snap, nodes)
	f.gangMembers(2)
	// The rival takes every GPU of the tray right after the controller's
	// snapshot has read the claims.
	rival := newClaim("rival", "gpu.tessera.dev", 4)
	rival.Status.Allocation = &resourceapi.AllocationResult{}
	for i := range 4 {
		rival.Status.Allocation.Devices.Results = append(rival.Status.Allocation.Devices.Results,
			resourceapi.DeviceRequestAllocationResult{Request: "gpus", Driver: driver, Pool: "a1", Device: fmt.Sprintf("gpu-%d", i)})
	}
	claims := resourceapi.SchemeGroupVersion.WithResource("resourceclaims")
	var armed, taken atomic.Bool
	f.client.PrependReactor("list", "resourceclaims", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if !armed.Load() || taken.Swap(true) {
			return false, nil, nil
		}
		list, err := f.client.Tracker().List(claims, resourceapi.SchemeGroupVersion.WithKind("ResourceClaim"), a.GetNamespace())
		if err == nil {
			err = f.client.Tracker().Add(rival)
		}
		return true, list, err
	})
	f.onReconcile = func() { armed.Store(true) }
	res, err := f.reconcile("ml", "g")
	if err != nil {
		t.Fatal(err)
	}
	if !taken.Load() {
		t.Fatal("the controller read no claims: the rival was never allocated")
	}
	for _, a := range f.client.Actions() {
		u, ok := a.(k8stesting.UpdateAction)
		if !ok || a.GetResource() != claims || a.GetSubresource() != "status" {
			continue
		}
		if c := u.GetObject().(*resourceapi.ResourceClaim); c.Status.Allocation != nil {
			t.Errorf("wrote claim %s allocated %+v beside the rival allocated after the snapshot", c.Name, c.Status.Allocation.Devices.Results)
		}
	}
	g := f.gang("ml", "g")
	if why := conditionMessage(&g.Status, gangv1.ConditionWaiting); !strings.Contains(why, "claim ml/rival") || res.requeueAfter <= 0 {
		t.Errorf("gang waits %q and looks again in %v; want a wait naming claim ml/rival and a look again", why, res.requeueAfter)
	}
	if _, ok := g.Annotations[gangv1.AnnotationUncommitted]; ok {
		t.Errorf("a placement was recorded although none was written")
	}
}
