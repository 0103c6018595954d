//go:build oracle

package slices_test

import (
	"context"
	"fmt"
	"testing"

	resourceapi "k8s.io/api/resource/v1"

	"github.com/tessera-dev/tessera/deviceclass"
	"github.com/tessera-dev/tessera/driver/gpumodel"
	"github.com/tessera-dev/tessera/driver/inventory"
	"github.com/tessera-dev/tessera/driver/simulate"
)

// The reference model of what one GPU can hold at once, from the documented
// rules alone (NVIDIA's MIG user guide): a GPU instance occupies the memory
// slices of its placement, two instances never share a slice, the whole GPU
// occupies every slice, and no profile has more instances than its
// instance count. It reads the model's table (the documented facts) and
// nothing of Tessera's code: not mig, inventory or slices.

// refItem is one thing a claim can take from a GPU.
type refItem struct {
	profile   string // "" for the whole GPU
	start     int
	size      int
	instances int // the profile's instance count
}

func (it refItem) String() string {
	if it.profile == "" {
		return "whole"
	}
	return fmt.Sprintf("%s@%d", it.profile, it.start)
}

// refItems lists a board's partitions at every documented placement, and
// the whole GPU where the board offers it beside partitions (Hopper and
// newer switch MIG mode without a reset).
func refItems(m gpumodel.Model) []refItem {
	var out []refItem
	for _, p := range m.MIG.Profiles {
		for _, s := range p.Starts {
			out = append(out, refItem{profile: p.Name, start: s, size: p.Size, instances: p.Instances})
		}
	}
	if !m.MIG.ResetToSwitch {
		out = append(out, refItem{start: 0, size: m.MIG.MemorySlices, instances: 1})
	}
	return out
}

// refFits says whether a GPU can hold every item of set at once.
func refFits(m gpumodel.Model, set []refItem) bool {
	used := make([]bool, m.MIG.MemorySlices)
	count := map[string]int{}
	for _, it := range set {
		for s := it.start; s < it.start+it.size; s++ {
			if used[s] {
				return false
			}
			used[s] = true
		}
		count[it.profile]++
		if count[it.profile] > it.instances {
			return false
		}
	}
	return true
}

// itemClaim asks for exactly one item of GPU 0.
func itemClaim(it refItem) *resourceapi.ResourceClaim {
	if it.profile == "" {
		return claim(request{count: 1, selectors: []string{`device.attributes["gpu.tessera.dev"].type == "gpu"`}})
	}
	c := claim(request{count: 1, selectors: []string{fmt.Sprintf(
		`device.attributes["gpu.tessera.dev"].profile == %q && device.attributes["gpu.tessera.dev"].placementStart == %d`, it.profile, it.start)}})
	c.Spec.Devices.Requests[0].Exactly.DeviceClassName = "mig.gpu.tessera.dev"
	return c
}

// TestAllocatorAcceptsExactlyWhatTheGPUCanHold (build tag oracle: about 350,000
// allocator calls, a few minutes without the race detector and far too long
// with it; make test runs it on its own) walks every set of partitions
// (and the whole GPU) one GPU of each MIG model can hold, per the reference
// model, and at each set asks the scheduler's allocator, over the slices
// Tessera publishes for that GPU with those devices allocated, for every
// other item: the allocator must grant exactly the items the reference says
// still fit. Every set the reference allows is reached (each once, items
// added in a fixed order), and every set it refuses has a smallest refused
// subset that is one item past an allowed set, so this checks both "nothing
// more" and "nothing less".
func TestAllocatorAcceptsExactlyWhatTheGPUCanHold(t *testing.T) {
	for _, name := range []string{"dgx-a100", "dgx-a100-80gb", "dgx-h100", "dgx-h200", "dgx-b200", "gb200-nvl72-tray"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			p := oneGPU(t, name)
			m := p.GPU
			if m.MIG.ResetToSwitch {
				p.MIGEnabled = []int{0} // Ampere offers partitions only in MIG mode
			}
			classes, err := deviceclass.All()
			if err != nil {
				t.Fatal(err)
			}
			c := simulate.New(classes, publishedWith(t, p, true, inventory.Pack))
			items := refItems(m)
			claims := make([]*resourceapi.ResourceClaim, len(items))
			for i, it := range items {
				claims[i] = itemClaim(it)
			}
			ctx := context.Background()
			sets, checks, mismatches := 0, 0, 0
			var walk func(held []refItem, results []resourceapi.AllocationResult, next int)
			walk = func(held []refItem, results []resourceapi.AllocationResult, next int) {
				sets++
				fits := make([]*resourceapi.AllocationResult, len(items))
				for i, it := range items {
					want := refFits(m, append(held[:len(held):len(held)], it))
					res, err := c.Allocate(ctx, node, claims[i])
					if err != nil {
						t.Fatalf("holding %v, allocate %v: %v", held, it, err)
					}
					checks++
					if got := res != nil; got != want {
						mismatches++
						if mismatches <= 20 {
							t.Errorf("holding %v, %v: allocator grants %v, the GPU can hold it: %v", held, it, got, want)
						}
					}
					if res != nil && want {
						fits[i] = &res[0]
					}
				}
				for i := next; i < len(items); i++ {
					if fits[i] == nil {
						continue
					}
					c.Commit(*fits[i])
					walk(append(held, items[i]), append(results, *fits[i]), i+1)
					c.Release(*fits[i])
				}
			}
			walk(nil, nil, 0)
			if mismatches > 20 {
				t.Errorf("... %d mismatches in all", mismatches)
			}
			t.Logf("%s: %d sets the GPU can hold, %d allocator checks", name, sets, checks)
		})
	}
}
