package gang

import (
	"fmt"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2/ktesting"

	"github.com/tessera-dev/tessera/controller/domains"
	"github.com/tessera-dev/tessera/deviceclass"
	"github.com/tessera-dev/tessera/driver/domain"
	"github.com/tessera-dev/tessera/driver/fakenode"
	"github.com/tessera-dev/tessera/driver/inventory"
	"github.com/tessera-dev/tessera/driver/simulate"
	"github.com/tessera-dev/tessera/test/fixtures"
)

const driver = "gpu.tessera.dev"

// trays builds GB200 trays (4 GPUs each) in cliques: node name -> clique ID.
func trays(t *testing.T, cliques map[string]uint32) (*simulate.Snapshot, map[string]*v1.Node) {
	t.Helper()
	classes, err := deviceclass.All()
	if err != nil {
		t.Fatal(err)
	}
	snap := &simulate.Snapshot{Classes: classes}
	nodes := map[string]*v1.Node{}
	var nodeList []*v1.Node
	for name, clique := range cliques {
		p := fixtures.Profile(t, "gb200-nvl72-tray")
		p.Fabric = &fakenode.Fabric{ClusterUUID: p.Fabric.ClusterUUID, CliqueID: clique}
		snap.Slices = append(snap.Slices, fixtures.Slices(t, p, name, inventory.Options{})...)
		n := &v1.Node{
			ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"kubernetes.io/hostname": name}},
			Status: v1.NodeStatus{Allocatable: v1.ResourceList{
				v1.ResourcePods: resource.MustParse("110"), v1.ResourceCPU: resource.MustParse("72"), v1.ResourceMemory: resource.MustParse("480Gi"),
			}},
		}
		nodes[name] = n
		nodeList = append(nodeList, n)
	}
	for pool, p := range domains.Resources(domains.Compute(nodeList, snap.Slices, driver, ""), 2).Pools {
		snap.Slices = append(snap.Slices, &resourceapi.ResourceSlice{
			ObjectMeta: metav1.ObjectMeta{Name: strings.ReplaceAll(pool, "/", "-")},
			Spec: resourceapi.ResourceSliceSpec{
				Driver: driver, Pool: resourceapi.ResourcePool{Name: pool, ResourceSliceCount: 1},
				NodeSelector: p.NodeSelector, Devices: p.Slices[0].Devices,
			},
		})
	}
	return snap, nodes
}

var uidSeq int

func newClaim(name, class string, count int64) *resourceapi.ResourceClaim {
	uidSeq++
	return &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ml", UID: types.UID(fmt.Sprintf("uid-%d", uidSeq))},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
			Name: "r", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: class, Count: count, AllocationMode: resourceapi.DeviceAllocationModeExactCount},
		}}}},
	}
}

// gangOf is the view of n members with one GPU claim each and a domain claim.
func gangOf(n int, gpus int64) *view {
	v := &view{domainClaim: newClaim("domain", "domain.gpu.tessera.dev", 1)}
	for i := range n {
		pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("m-%d", i), Namespace: "ml"}}
		v.live = append(v.live, &member{pod: pod, rank: i, claims: []*resourceapi.ResourceClaim{newClaim(fmt.Sprintf("gpu-%d", i), "gpu.tessera.dev", gpus)}})
	}
	return v
}

func poolOf(clique uint32) string {
	return domain.PoolName(domain.KindNVLink, fmt.Sprintf("7b2f0c5e-1d4a-4e8b-9c3f-0a6d5e4b3c21.%d", clique))
}

func TestSearchChoosesTheSmallestDomainThatFitsTheWholeGang(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	snap, nodes := trays(t, map[string]uint32{"a1": 1, "b1": 2, "b2": 2, "b3": 2})
	for _, tc := range []struct {
		members int
		gpus    int64
		pool    string
	}{
		{4, 1, poolOf(1)}, // fits both: the one-tray clique
		{1, 4, poolOf(1)},
		{5, 1, poolOf(2)}, // only the three-tray clique
		{3, 4, poolOf(2)},
	} {
		p, verdicts, err := search(ctx, snap, driver, nodes, newCapacity(nodes, nil), gangOf(tc.members, tc.gpus))
		if err != nil {
			t.Fatal(err)
		}
		if p == nil {
			t.Errorf("%d members x %d GPUs: no fit (%s), want %s", tc.members, tc.gpus, noFitMessage(tc.members, verdicts), tc.pool)
			continue
		}
		if p.pool != tc.pool || p.domainAlloc == nil || p.domainAlloc.Devices.Results[0].Pool != tc.pool || len(p.nodes) != tc.members {
			t.Errorf("%d members x %d GPUs: placed in %s (domain claim %+v) on %v, want %s", tc.members, tc.gpus, p.pool, p.domainAlloc, p.nodes, tc.pool)
		}
	}
}

func TestSearchSaysWhatTheClosestDomainLacks(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	snap, nodes := trays(t, map[string]uint32{"a1": 1, "b1": 2, "b2": 2, "b3": 2})
	p, verdicts, err := search(ctx, snap, driver, nodes, newCapacity(nodes, nil), gangOf(16, 1))
	if err != nil {
		t.Fatal(err)
	}
	if p != nil {
		t.Fatalf("16 one-GPU members fit in %s on %v; the largest domain has 12 GPUs", p.pool, p.nodes)
	}
	msg := noFitMessage(16, verdicts)
	if !strings.Contains(msg, poolOf(2)+": room for 12 of 16 members") || strings.Index(msg, poolOf(2)) > strings.Index(msg, poolOf(1)) {
		t.Errorf("message %q: want the three-tray clique first, with room for 12 of 16", msg)
	}
}

func TestSearchCountsEveryAllocatedClaim(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	snap, nodes := trays(t, map[string]uint32{"a1": 1, "b1": 2, "b2": 2, "b3": 2})
	// Another workload holds a GPU of the one-tray clique: a gang of four
	// one-GPU members goes to the larger clique.
	other := newClaim("other", "gpu.tessera.dev", 1)
	res, err := snap.Cluster(nil, nil).Allocate(ctx, "a1", other)
	if err != nil || res == nil {
		t.Fatalf("allocate the other claim: %v, %v", res, err)
	}
	other.Status.Allocation = &res[0]
	snap.Claims = append(snap.Claims, other)
	p, _, err := search(ctx, snap, driver, nodes, newCapacity(nodes, nil), gangOf(4, 1))
	if err != nil || p == nil {
		t.Fatalf("no fit: %v", err)
	}
	if p.pool != poolOf(2) {
		t.Errorf("placed in %s, want %s: a1 has only 3 free GPUs", p.pool, poolOf(2))
	}
	taken := res[0].Devices.Results[0]
	for i, allocs := range p.allocs {
		for _, r := range allocs[0].Devices.Results {
			if r.Pool == taken.Pool && r.Device == taken.Device {
				t.Errorf("member %d got %s/%s, which the other claim holds", i, r.Pool, r.Device)
			}
		}
	}
}

// withCPU gives every member a container requesting cpu.
func withCPU(v *view, cpu string) *view {
	for _, m := range v.live {
		m.pod.Spec.Containers = []v1.Container{{Name: "w", Resources: v1.ResourceRequirements{Requests: v1.ResourceList{v1.ResourceCPU: resource.MustParse(cpu)}}}}
	}
	return v
}

func TestSearchLeavesOutNodesWithoutRoomForTheMembersPods(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	snap, nodes := trays(t, map[string]uint32{"a1": 1, "b1": 2, "b2": 2, "b3": 2})
	// a1 has the GPUs for four one-GPU members of 30 CPUs each, but 72
	// CPUs: only two fit there, so the gang goes to the larger clique.
	p, _, err := search(ctx, snap, driver, nodes, newCapacity(nodes, nil), withCPU(gangOf(4, 1), "30"))
	if err != nil || p == nil {
		t.Fatalf("no fit: %v", err)
	}
	if p.pool != poolOf(2) {
		t.Errorf("placed in %s on %v, want %s: a1 has CPUs for two members only", p.pool, p.nodes, poolOf(2))
	}
	perNode := map[string]int{}
	for _, n := range p.nodes {
		perNode[n]++
	}
	for n, k := range perNode {
		if k > 2 {
			t.Errorf("%d members of 30 CPUs on %s, which has 72", k, n)
		}
	}

	// Pods already running on the trays count too: with 50 CPUs taken on
	// every tray, no domain has room, and the message says what is short.
	var running []*v1.Pod
	for name := range nodes {
		running = append(running, &v1.Pod{Spec: v1.PodSpec{NodeName: name, Containers: []v1.Container{{Name: "c", Resources: v1.ResourceRequirements{Requests: v1.ResourceList{v1.ResourceCPU: resource.MustParse("50")}}}}}})
	}
	p, verdicts, err := search(ctx, snap, driver, nodes, newCapacity(nodes, running), withCPU(gangOf(4, 1), "30"))
	if err != nil {
		t.Fatal(err)
	}
	if p != nil {
		t.Fatalf("placed on %v, though every tray has 22 CPUs free for members of 30", p.nodes)
	}
	if msg := noFitMessage(4, verdicts); !strings.Contains(msg, "lacks cpu (requests 30, 22 free)") {
		t.Errorf("message %q, want the CPU shortage named", msg)
	}
}
