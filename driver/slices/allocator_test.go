package slices_test

import (
	"context"
	"fmt"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	"github.com/tessera-dev/tessera/deviceclass"
	"github.com/tessera-dev/tessera/driver/fakenode"
	"github.com/tessera-dev/tessera/driver/inventory"
	"github.com/tessera-dev/tessera/driver/simulate"
	"github.com/tessera-dev/tessera/driver/slices"
	"github.com/tessera-dev/tessera/test/fixtures"
)

const node = "node-a"

// published returns the slices a fake node publishes, as the API server
// would hold them, with whole GPUs only.
func published(t *testing.T, p fakenode.Profile) []*resourceapi.ResourceSlice {
	return publishedWith(t, p, false, inventory.Pack)
}

// publishedWith lays the node out with or without dynamic MIG, in an order.
func publishedWith(t *testing.T, p fakenode.Profile, dynamicMIG bool, order inventory.Order) []*resourceapi.ResourceSlice {
	return fixtures.Slices(t, p, node, inventory.Options{DynamicMIG: dynamicMIG, Order: order})
}

func profile(t *testing.T, name string) fakenode.Profile { return fixtures.Profile(t, name) }

func cluster(t *testing.T, p fakenode.Profile) *simulate.Cluster {
	t.Helper()
	classes, err := deviceclass.All()
	if err != nil {
		t.Fatal(err)
	}
	return simulate.New(classes, published(t, p))
}

type request struct {
	count     int64
	selectors []string
	match     string // matchAttribute across the request's devices
}

var claimSeq int

func claim(reqs ...request) *resourceapi.ResourceClaim {
	claimSeq++
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{
		Name: fmt.Sprintf("claim-%d", claimSeq), Namespace: "default", UID: types.UID(fmt.Sprintf("uid-%d", claimSeq)),
	}}
	for i, r := range reqs {
		name := fmt.Sprintf("r%d", i)
		dr := resourceapi.DeviceRequest{Name: name, Exactly: &resourceapi.ExactDeviceRequest{
			DeviceClassName: slices.DriverName, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: r.count,
		}}
		for _, s := range r.selectors {
			dr.Exactly.Selectors = append(dr.Exactly.Selectors, resourceapi.DeviceSelector{CEL: &resourceapi.CELDeviceSelector{Expression: s}})
		}
		c.Spec.Devices.Requests = append(c.Spec.Devices.Requests, dr)
		if r.match != "" {
			c.Spec.Devices.Constraints = append(c.Spec.Devices.Constraints, resourceapi.DeviceConstraint{
				Requests: []string{name}, MatchAttribute: ptr.To(resourceapi.FullyQualifiedName(r.match)),
			})
		}
	}
	return c
}

func allocate(t *testing.T, c *simulate.Cluster, claims ...*resourceapi.ResourceClaim) []resourceapi.AllocationResult {
	t.Helper()
	res, err := c.Allocate(context.Background(), node, claims...)
	if err != nil {
		t.Fatalf("allocator error: %v", err)
	}
	return res
}

// attrs maps device name to its published attributes.
func attrs(sl []*resourceapi.ResourceSlice) map[string]map[resourceapi.QualifiedName]resourceapi.DeviceAttribute {
	out := map[string]map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{}
	for _, s := range sl {
		for _, d := range s.Spec.Devices {
			out[d.Name] = d.Attributes
		}
	}
	return out
}

const (
	nvlinkDomain = slices.DriverName + "/" + slices.AttrNVLinkDomain
	pcieRoot     = "resource.kubernetes.io/pcieRoot"
)

func TestAllocatorCountsOnADGX(t *testing.T) {
	for _, n := range []int64{1, 2, 8} {
		c := cluster(t, profile(t, "dgx-h100"))
		res := allocate(t, c, claim(request{count: n}))
		if len(res) != 1 || int64(len(res[0].Devices.Results)) != n {
			t.Fatalf("count %d: got %v", n, res)
		}
		seen := map[string]bool{}
		for _, r := range res[0].Devices.Results {
			if r.Driver != slices.DriverName || r.Pool != node || seen[r.Device] {
				t.Errorf("count %d: bad or repeated result %+v", n, r)
			}
			seen[r.Device] = true
		}
	}
	if res := allocate(t, cluster(t, profile(t, "dgx-h100")), claim(request{count: 9})); res != nil {
		t.Errorf("9 GPUs allocated on an 8-GPU node: %v", res)
	}
}

func TestAllocatorNeverHandsOutAGPUTwice(t *testing.T) {
	c := cluster(t, profile(t, "pcie-l4x4"))
	taken := map[string]bool{}
	for i := 0; i < 4; i++ {
		res := allocate(t, c, claim(request{count: 1}))
		if res == nil {
			t.Fatalf("claim %d did not fit on a node with %d free GPUs", i, 4-i)
		}
		d := res[0].Devices.Results[0].Device
		if taken[d] {
			t.Fatalf("%s allocated twice", d)
		}
		taken[d] = true
		c.Commit(res...)
	}
	if res := allocate(t, c, claim(request{count: 1})); res != nil {
		t.Errorf("a fifth GPU allocated on a full 4-GPU node: %v", res)
	}
}

func TestAllocatorCELOnProductAndMemory(t *testing.T) {
	l4 := `device.attributes["gpu.tessera.dev"].productName == "NVIDIA L4"`
	big := `device.capacity["gpu.tessera.dev"].memory.compareTo(quantity("40Gi")) >= 0`
	hopper := `device.attributes["gpu.tessera.dev"].architecture == "Hopper" && device.attributes["gpu.tessera.dev"].cudaComputeCapability.isGreaterThan(semver("8.9.0"))`
	for _, tc := range []struct {
		profile  string
		selector string
		fits     bool
	}{
		{"pcie-l4x4", l4, true},
		{"dgx-h100", l4, false},
		{"dgx-h100", big, true},
		{"pcie-l4x4", big, false},
		{"dgx-h200", hopper, true},
		{"dgx-a100", hopper, false},
	} {
		res := allocate(t, cluster(t, profile(t, tc.profile)), claim(request{count: 1, selectors: []string{tc.selector}}))
		if (res != nil) != tc.fits {
			t.Errorf("%s with %q: allocated %v, want fit %v", tc.profile, tc.selector, res != nil, tc.fits)
		}
	}
}

// TestDriverVersionIsASemanticVersionForCEL: a driver that reports
// 570.124.06 publishes driverVersion 570.124.6, which CEL compares as a
// version (a zero-padded part would not parse), while its files keep the
// name the driver gives them (TestEveryProfilesSpecsMountEveryDriverFileItsRootHolds
// [driver/plugin]).
func TestDriverVersionIsASemanticVersionForCEL(t *testing.T) {
	for _, tc := range []struct {
		profile, want string
	}{
		{"dgx-b200", "570.124.6"},
		{"dgx-h200", "550.90.7"},
		{"pcie-l4x4", "535.183.1"},
		{"dgx-h100", "550.54.15"},
	} {
		p := profile(t, tc.profile)
		for name, a := range attrs(published(t, p)) {
			if v := a[slices.AttrDriverVersion].VersionValue; v == nil || *v != tc.want {
				t.Errorf("%s %s: driverVersion %v, want version %s", tc.profile, name, v, tc.want)
			}
		}
		newer := `device.attributes["gpu.tessera.dev"].driverVersion.isGreaterThan(semver("550.54.15"))`
		res := allocate(t, cluster(t, p), claim(request{count: 1, selectors: []string{newer}}))
		if wantFit := tc.profile == "dgx-b200" || tc.profile == "dgx-h200"; (res != nil) != wantFit {
			t.Errorf("%s: a driver newer than 550.54.15 allocated %v, want %v", tc.profile, res != nil, wantFit)
		}
	}
}

func TestAllocatorMatchesNVLinkDomain(t *testing.T) {
	whole := profile(t, "dgx-h100")
	if res := allocate(t, cluster(t, whole), claim(request{count: 8, match: nvlinkDomain})); res == nil {
		t.Fatal("8 GPUs on one NVLink domain did not fit on a DGX H100")
	}

	split := profile(t, "dgx-h100")
	split.NVLinkIslands = [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}}
	sl := published(t, split)
	classes, _ := deviceclass.All()
	c := simulate.New(classes, sl)
	if res := allocate(t, c, claim(request{count: 5, match: nvlinkDomain})); res != nil {
		t.Fatalf("5 GPUs on one NVLink domain allocated on a node of two 4-GPU islands: %v", res[0].Devices.Results)
	}
	if res := allocate(t, c, claim(request{count: 5})); res == nil {
		t.Fatal("5 GPUs without the constraint did not fit")
	}
	res := allocate(t, c, claim(request{count: 4, match: nvlinkDomain}))
	if res == nil {
		t.Fatal("4 GPUs on one island did not fit")
	}
	a := attrs(sl)
	first := *a[res[0].Devices.Results[0].Device][slices.AttrNVLinkDomain].StringValue
	for _, r := range res[0].Devices.Results {
		if got := *a[r.Device][slices.AttrNVLinkDomain].StringValue; got != first {
			t.Errorf("%s is on domain %s, others on %s", r.Device, got, first)
		}
	}
	// Once one island is partly taken, a 4-GPU island claim must use the other.
	c.Commit(allocate(t, c, claim(request{count: 1}))...)
	if res := allocate(t, c, claim(request{count: 4, match: nvlinkDomain})); res == nil {
		t.Fatal("the untouched island was not used")
	}
}

func TestAllocatorMatchesPCIeRoot(t *testing.T) {
	sl := published(t, profile(t, "dgx-h100"))
	classes, _ := deviceclass.All()
	c := simulate.New(classes, sl)
	res := allocate(t, c, claim(request{count: 2, match: pcieRoot}))
	if res == nil {
		t.Fatal("two GPUs on one PCIe root did not fit on a DGX (two per root)")
	}
	a := attrs(sl)
	r := res[0].Devices.Results
	if *a[r[0].Device][pcieRoot].StringValue != *a[r[1].Device][pcieRoot].StringValue {
		t.Errorf("%s and %s are on different roots", r[0].Device, r[1].Device)
	}
	if res := allocate(t, c, claim(request{count: 3, match: pcieRoot})); res != nil {
		t.Errorf("three GPUs on one root allocated where roots hold two: %v", res[0].Devices.Results)
	}
}

func TestUnsatisfiableClaimGetsNoAllocation(t *testing.T) {
	c := cluster(t, profile(t, "pcie-l4x4"))
	for _, cl := range []*resourceapi.ResourceClaim{
		claim(request{count: 5}),
		claim(request{count: 2, match: nvlinkDomain}), // L4s have no NVLink peers
		claim(request{count: 1, selectors: []string{`device.attributes["gpu.tessera.dev"].migCapable`}}),
	} {
		if res := allocate(t, c, cl); res != nil {
			t.Errorf("%s allocated: %v", cl.Name, res[0].Devices.Results)
		}
	}
}
