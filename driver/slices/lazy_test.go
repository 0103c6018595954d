package slices_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/tessera-dev/tessera/deviceclass"
	"github.com/tessera-dev/tessera/driver/inventory"
	"github.com/tessera-dev/tessera/driver/lazymig"
	"github.com/tessera-dev/tessera/driver/simulate"
	"github.com/tessera-dev/tessera/driver/slices"
	"github.com/tessera-dev/tessera/test/fixtures"
)

// lazyNode is a DGX H100 published lazily, with its claims prepared the
// moment they are allocated (nothing in flight, so a withdrawal is never
// early): after each change the node decides (lazymig) and republishes
// (slices.Build), as the kubelet plugin does.
type lazyNode struct {
	t         *testing.T
	inv       *inventory.Inventory
	policy    lazymig.Policy
	now       time.Time
	published map[string]lazymig.State
	c         *simulate.Cluster
	held      map[string]int // device name -> claims holding it
}

// newLazyNode is an empty DGX H100 published lazily with one spare.
func newLazyNode(t *testing.T) *lazyNode {
	t.Helper()
	classes, err := deviceclass.All()
	if err != nil {
		t.Fatal(err)
	}
	_, gpus := fixtures.Node(t, profile(t, "dgx-h100"), node)
	n := &lazyNode{t: t, inv: inventory.Build(gpus, inventory.Options{DynamicMIG: true}), policy: lazymig.Policy{Spares: 1, Grace: time.Minute}, c: simulate.New(classes, nil), held: map[string]int{}}
	n.republish()
	return n
}

func (n *lazyNode) republish() {
	n.t.Helper()
	partitioned, whole := map[string]bool{}, map[string]bool{}
	for name, k := range n.held {
		if k == 0 {
			continue
		}
		d, _ := n.inv.Lookup(name)
		if d.Kind == inventory.Partition {
			partitioned[d.GPU.Name()] = true
		} else {
			whole[d.GPU.Name()] = true
		}
	}
	var gpus []lazymig.GPU
	for _, g := range n.inv.CounterSets {
		gpus = append(gpus, lazymig.GPU{Name: g.Name(), Partitioned: partitioned[g.Name()], WholeHeld: whole[g.Name()], Published: n.published[g.Name()]})
	}
	d := lazymig.Decide(gpus, n.policy, n.now)
	n.published = d.States
	res, err := slices.Build(node, n.inv, slices.Options{Lazy: &d})
	if err != nil {
		n.t.Fatal(err)
	}
	var out []*resourceapi.ResourceSlice
	for _, s := range slices.Objects(node, res) {
		out = append(out, &s)
	}
	n.c.Publish(out)
}

// TestLazyPublishingRefusesNothingThatFitsAndNeverOverlaps runs random
// sequences of single-partition and whole-GPU claims and releases on a DGX
// H100 published lazily, with the real allocator, beside the same node
// publishing every partition. Each claim must fit lazily exactly when it
// fits with every partition published (with one spare or more, lazy
// publishing gives up nothing a one-device claim can ask), and what is
// held never overlaps (inventory.Overlap, the prepare side's check).
func TestLazyPublishingRefusesNothingThatFitsAndNeverOverlaps(t *testing.T) {
	classes, err := deviceclass.All()
	if err != nil {
		t.Fatal(err)
	}
	_, gpus := fixtures.Node(t, profile(t, "dgx-h100"), node)
	inv := inventory.Build(gpus, inventory.Options{DynamicMIG: true})
	var profiles []string
	seen := map[string]bool{}
	for _, d := range inv.Devices {
		if d.Kind == inventory.Partition && !seen[d.Profile.Name] {
			seen[d.Profile.Name] = true
			profiles = append(profiles, d.Profile.Name)
		}
	}
	rng := rand.New(rand.NewPCG(7, 8))
	for seq := range 6 {
		full := simulate.New(classes, publishedWith(t, profile(t, "dgx-h100"), true, inventory.Pack))
		n := &lazyNode{t: t, inv: inv, policy: lazymig.Policy{Spares: 1 + seq%2, Grace: time.Minute}, now: time.Date(2026, 12, 3, 0, 0, 0, 0, time.UTC), c: simulate.New(classes, nil), held: map[string]int{}}
		n.republish()
		var held [][]resourceapi.AllocationResult
		lazyFits := 0
		for step := range 120 {
			where := fmt.Sprintf("sequence %d (spares %d) step %d", seq, n.policy.Spares, step)
			switch op := rng.IntN(10); {
			case op < 6:
				c := wholeClaim()
				what := "a whole GPU"
				if op < 5 {
					what = profiles[rng.IntN(len(profiles))]
					c = profileClaim(what)
				}
				lres := allocate(t, n.c, c)
				fres := allocate(t, full, c)
				if (lres == nil) != (fres == nil) {
					t.Fatalf("%s: %s fits lazily: %v, with every partition published: %v (lazy publishes %v)", where, what, lres != nil, fres != nil, n.published)
				}
				if lres == nil {
					continue
				}
				lazyFits++
				dev := lres[0].Devices.Results[0].Device
				d, _ := inv.Lookup(dev)
				for other, k := range n.held {
					if o, _ := inv.Lookup(other); k > 0 && inventory.Overlap(d, o) {
						t.Fatalf("%s: %s was allocated %s, which overlaps %s, held", where, what, dev, other)
					}
				}
				n.c.Commit(lres...)
				full.Commit(lres...)
				n.held[dev]++
				held = append(held, lres)
			case op < 9 && len(held) > 0:
				i := rng.IntN(len(held))
				r := held[i]
				held = append(held[:i], held[i+1:]...)
				n.c.Release(r...)
				full.Release(r...)
				n.held[r[0].Devices.Results[0].Device]--
			default:
				n.now = n.now.Add(time.Duration(rng.IntN(90)) * time.Second)
			}
			n.republish()
		}
		if lazyFits < 20 {
			t.Fatalf("sequence %d: only %d claims fitted; the sequence tests little", seq, lazyFits)
		}
	}
}

// TestLazyPublishingPacksPartitions: a partition lands beside the node's
// others before it opens the spare, whose index is above theirs.
func TestLazyPublishingPacksPartitions(t *testing.T) {
	n := newLazyNode(t)
	var got []string
	for range 7 {
		res := allocate(t, n.c, profileClaim("1g.10gb"))
		if res == nil {
			t.Fatalf("a 1g.10gb did not fit after %v", got)
		}
		dev := res[0].Devices.Results[0].Device
		d, _ := n.inv.Lookup(dev)
		got = append(got, d.GPU.Name())
		n.c.Commit(res...)
		n.held[dev]++
		n.republish()
	}
	for _, g := range got {
		if g != "gpu-7" {
			t.Fatalf("seven 1g.10gb went to %v, want all on gpu-7 (the first GPU partitioned)", got)
		}
	}
}

// TestAWholeGPUTakenWhileClosedBlocksItsPartitionsWhenTheyOpen: published
// lazily, a GPU whose partitions are not published offers a whole device
// that draws on no counters. The plugin may open its partitions before it
// learns that the scheduler allocated that whole device (a prepare comes
// after the allocation): the scheduler, working out what allocated devices
// consume from the devices as published now, must then refuse every
// partition of it. The real allocator decides here, over every partition.
func TestAWholeGPUTakenWhileClosedBlocksItsPartitionsWhenTheyOpen(t *testing.T) {
	n := newLazyNode(t)
	res := allocate(t, n.c, wholeClaim())
	if res == nil || res[0].Devices.Results[0].Device != "gpu-0" {
		t.Fatalf("a whole GPU on an empty node: %v, want gpu-0", res)
	}
	n.c.Commit(res...)
	// The plugin has not seen the allocation and opens every GPU.
	n.policy.Spares = 8
	n.republish()
	if _, open := n.published["gpu-0"]; !open {
		t.Fatalf("gpu-0's partitions are not published: %v", n.published)
	}
	for _, prof := range []string{"1g.10gb", "3g.40gb", "7g.80gb"} {
		for {
			res := allocate(t, n.c, profileClaim(prof))
			if res == nil {
				break
			}
			d, _ := n.inv.Lookup(res[0].Devices.Results[0].Device)
			if d.GPU.Name() == "gpu-0" {
				t.Fatalf("%s was allocated on gpu-0, which is allocated whole", d.Name)
			}
			n.c.Commit(res...)
		}
	}
}

// TestAClaimThatToleratesEveryTaintIsNotAllocatedAPartitionBeingWithdrawn:
// a claim that tolerates every taint (docs/gang.md recommends it for
// health taints) could be allocated a partition of a GPU being withdrawn at
// the grace's last moment; the scheduler writes its allocation only in
// PreBind, after the pod's volumes are bound, so the plugin's claim check
// at the grace's end would miss it and withdraw the partition, and the
// scheduler, counting only published partitions against their GPU, would
// then hand the whole GPU out over it. The real allocator decides here.
func TestAClaimThatToleratesEveryTaintIsNotAllocatedAPartitionBeingWithdrawn(t *testing.T) {
	n := newLazyNode(t)
	n.now = time.Date(2026, 12, 4, 0, 0, 0, 0, time.UTC)
	// A 1g.10gb held on the spare (gpu-7) opens gpu-6 as the next spare;
	// released, gpu-7 is the spare again and gpu-6 is being withdrawn.
	res := allocate(t, n.c, profileClaim("1g.10gb"))
	if res == nil {
		t.Fatal("a 1g.10gb does not fit on an empty node")
	}
	n.c.Commit(res...)
	dev := res[0].Devices.Results[0].Device
	n.held[dev]++
	n.republish()
	n.c.Release(res...)
	n.held[dev]--
	n.republish()
	if s := n.published["gpu-6"]; !s.IsClosing() {
		t.Fatalf("gpu-6's partitions are %+v, want published and being withdrawn (published: %v)", s, n.published)
	}
	tolerating := func(c *resourceapi.ResourceClaim) *resourceapi.ResourceClaim {
		c.Spec.Devices.Requests[0].Exactly.Tolerations = []resourceapi.DeviceToleration{{Operator: resourceapi.DeviceTolerationOpExists}}
		return c
	}
	onGPU6 := tolerating(profileClaim("1g.10gb"))
	onGPU6.Spec.Devices.Requests[0].Exactly.Selectors = append(onGPU6.Spec.Devices.Requests[0].Exactly.Selectors,
		resourceapi.DeviceSelector{CEL: &resourceapi.CELDeviceSelector{Expression: `device.attributes["gpu.tessera.dev"].parentIndex == 6`}})
	if res := allocate(t, n.c, onGPU6); res != nil {
		t.Fatalf("a claim tolerating every taint was allocated %s, a partition of gpu-6, which is being withdrawn", res[0].Devices.Results[0].Device)
	}
	for range 7 {
		res := allocate(t, n.c, tolerating(profileClaim("1g.10gb")))
		if res == nil {
			t.Fatal("a 1g.10gb tolerating every taint did not fit on the spare")
		}
		d, _ := n.inv.Lookup(res[0].Devices.Results[0].Device)
		if d.GPU.Name() != "gpu-7" {
			t.Fatalf("a claim tolerating every taint was allocated %s on %s, want the spare gpu-7", d.Name, d.GPU.Name())
		}
		n.c.Commit(res...)
	}
}

// TestAHeldPartitionOfAGPUBeingWithdrawnStillFitsItsClaim: a claim allocated
// a partition of the spare, not prepared yet, whose GPU then starts being
// withdrawn (another claim's release moved the spare back): the gang
// controller's re-check of a bound member (simulate.Cluster.RefitHeld, as
// controller/gang's heldMisfit uses it) must judge the claim still
// fitting, since nothing else
// holds the partition; the withdrawal taint and the withdrawing counter
// only keep new claims off it. Judged wrong, a gang member waiting to be
// prepared would be evicted after the unschedulable grace for "a device
// another claim holds".
func TestAHeldPartitionOfAGPUBeingWithdrawnStillFitsItsClaim(t *testing.T) {
	n := newLazyNode(t)
	n.now = time.Date(2026, 12, 4, 0, 0, 0, 0, time.UTC)
	a := allocate(t, n.c, profileClaim("1g.10gb"))
	n.c.Commit(a...)
	devA := a[0].Devices.Results[0].Device
	n.held[devA]++
	n.republish() // A's GPU partitioned; gpu-6 the spare
	b := profileClaim("1g.10gb")
	b.Spec.Devices.Requests[0].Exactly.Selectors = append(b.Spec.Devices.Requests[0].Exactly.Selectors,
		resourceapi.DeviceSelector{CEL: &resourceapi.CELDeviceSelector{Expression: `device.attributes["gpu.tessera.dev"].parentIndex == 6`}})
	rb := allocate(t, n.c, b)
	if rb == nil {
		t.Fatal("no 1g.10gb partition of the spare gpu-6")
	}
	b.Status.Allocation = &rb[0]
	nd := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: node, Labels: map[string]string{"kubernetes.io/hostname": node}}}
	// A's pod ends before B's is prepared: the spare moves back to gpu-7,
	// and gpu-6's partitions are tainted and marked withdrawing.
	n.c.Release(a...)
	n.held[devA]--
	n.republish()
	if !n.published["gpu-6"].IsClosing() {
		t.Fatalf("gpu-6 is %+v, want it being withdrawn", n.published["gpu-6"])
	}
	fits, err := n.c.RefitHeld(context.Background(), nd, b)
	if err != nil || !fits {
		t.Errorf("claim B, allocated %s of gpu-6 and held by nothing else, re-checked while gpu-6 is withdrawn: fits %v, %v; want it to fit", rb[0].Devices.Results[0].Device, fits, err)
	}
	// Held by B, the partition still keeps another claim off it.
	n.c.Commit(rb...)
	other := profileClaim("1g.10gb")
	other.Spec.Devices.Requests[0].Exactly.Selectors = b.Spec.Devices.Requests[0].Exactly.Selectors
	other.Spec.Devices.Requests[0].Exactly.Tolerations = []resourceapi.DeviceToleration{{Operator: resourceapi.DeviceTolerationOpExists}}
	if got := allocate(t, n.c, other); got != nil {
		t.Errorf("a claim tolerating every taint was allocated %s of gpu-6 while it is withdrawn", got[0].Devices.Results[0].Device)
	}
}
