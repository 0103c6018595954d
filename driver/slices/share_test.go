package slices_test

import (
	"context"
	"fmt"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/tessera-dev/tessera/deviceclass"
	"github.com/tessera-dev/tessera/driver/discovery"
	"github.com/tessera-dev/tessera/driver/inventory"
	"github.com/tessera-dev/tessera/driver/simulate"
	"github.com/tessera-dev/tessera/test/fixtures"
)

// sharedCluster publishes a pcie-l4x4 node (24 GiB L4s) whose GPU 0 is
// shared as share says and the rest are whole.
func sharedCluster(t *testing.T, share inventory.Share) *simulate.Cluster {
	t.Helper()
	classes, err := deviceclass.All()
	if err != nil {
		t.Fatal(err)
	}
	sl := fixtures.Slices(t, profile(t, "pcie-l4x4"), node, inventory.Options{Sharing: func(g discovery.GPU) inventory.Share {
		if g.Index == 0 {
			return share
		}
		return inventory.Share{}
	}})
	return simulate.New(classes, sl)
}

func shareClaim(class string, capacity map[string]string) *resourceapi.ResourceClaim {
	claimSeq++
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{
		Name: fmt.Sprintf("share-%d", claimSeq), Namespace: "default", UID: types.UID(fmt.Sprintf("uid-share-%d", claimSeq)),
	}}
	req := &resourceapi.ExactDeviceRequest{DeviceClassName: class, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1}
	if len(capacity) > 0 {
		req.Capacity = &resourceapi.CapacityRequirements{Requests: map[resourceapi.QualifiedName]resource.Quantity{}}
		for k, v := range capacity {
			req.Capacity.Requests[resourceapi.QualifiedName(k)] = resource.MustParse(v)
		}
	}
	c.Spec.Devices.Requests = []resourceapi.DeviceRequest{{Name: "gpu", Exactly: req}}
	return c
}

// place allocates and commits one claim, returning its device and consumed
// capacity, or "" when it does not fit.
func place(t *testing.T, c *simulate.Cluster, claim *resourceapi.ResourceClaim) (string, resourceapi.DeviceRequestAllocationResult) {
	t.Helper()
	res, err := c.Allocate(context.Background(), node, claim)
	if err != nil {
		t.Fatalf("%s: %v", claim.Name, err)
	}
	if res == nil {
		return "", resourceapi.DeviceRequestAllocationResult{}
	}
	c.Commit(res...)
	r := res[0].Devices.Results[0]
	return r.Device, r
}

func TestMemorySharesShareOneGPUAndNeverOvercommit(t *testing.T) {
	c := sharedCluster(t, inventory.Share{Memory: true})
	// An L4 has 23034 MiB in the mock: 22 whole GiB can be handed out.
	var results []resourceapi.DeviceRequestAllocationResult
	for _, amount := range []string{"10Gi", "10Gi"} {
		dev, r := place(t, c, shareClaim("memory.gpu.tessera.dev", map[string]string{"memory": amount}))
		if dev != "gpu-0" {
			t.Fatalf("memory share of %s placed on %q, want the memory-shared gpu-0", amount, dev)
		}
		if r.ShareID == nil {
			t.Errorf("memory share has no share ID")
		}
		results = append(results, r)
	}
	if got := results[0].ConsumedCapacity["memory"]; got.Cmp(resource.MustParse("10Gi")) != 0 {
		t.Errorf("consumed memory %s, want 10Gi", got.String())
	}
	if dev, _ := place(t, c, shareClaim("memory.gpu.tessera.dev", map[string]string{"memory": "3Gi"})); dev != "" {
		t.Errorf("a share that would overcommit gpu-0 (10+10+3 GiB of 22) was placed on %s", dev)
	}
	if dev, r := place(t, c, shareClaim("memory.gpu.tessera.dev", map[string]string{"memory": "1500Mi"})); dev != "gpu-0" {
		t.Errorf("a share that fits was not placed: %q", dev)
	} else if got := r.ConsumedCapacity["memory"]; got.Cmp(resource.MustParse("2Gi")) != 0 {
		t.Errorf("1500Mi consumed %s, want it rounded up to 2Gi", got.String())
	}
	// A whole-GPU claim never lands on the shared GPU.
	for range 3 {
		if dev, _ := place(t, c, shareClaim("gpu.tessera.dev", nil)); dev == "gpu-0" || dev == "" {
			t.Errorf("whole-GPU claim placed on %q, want one of gpu-1..3", dev)
		}
	}
	if dev, _ := place(t, c, shareClaim("gpu.tessera.dev", nil)); dev != "" {
		t.Errorf("a fourth whole-GPU claim was placed on %s, which is shared", dev)
	}
}

func TestTimeSlicesAreHandedOutUpToN(t *testing.T) {
	c := sharedCluster(t, inventory.Share{TimeSlices: 3})
	for i := range 3 {
		if dev, _ := place(t, c, shareClaim("timeslice.gpu.tessera.dev", nil)); dev != "gpu-0" {
			t.Fatalf("slice %d placed on %q, want gpu-0", i, dev)
		}
	}
	if dev, _ := place(t, c, shareClaim("timeslice.gpu.tessera.dev", nil)); dev != "" {
		t.Errorf("a fourth slice of a 3-slice GPU was placed on %s", dev)
	}
	// A claim asking for two slices of a fresh GPU takes two.
	c = sharedCluster(t, inventory.Share{TimeSlices: 3})
	if dev, r := place(t, c, shareClaim("timeslice.gpu.tessera.dev", map[string]string{"timeSlices": "2"})); dev != "gpu-0" {
		t.Fatalf("two-slice claim placed on %q", dev)
	} else if got := r.ConsumedCapacity["timeSlices"]; got.Value() != 2 {
		t.Errorf("two-slice claim consumed %s slices", got.String())
	}
	if dev, _ := place(t, c, shareClaim("timeslice.gpu.tessera.dev", map[string]string{"timeSlices": "2"})); dev != "" {
		t.Errorf("2+2 slices of a 3-slice GPU were handed out (%s)", dev)
	}
}
