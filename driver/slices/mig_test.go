package slices_test

import (
	"fmt"
	"sort"
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"

	"github.com/tessera-dev/tessera/deviceclass"
	"github.com/tessera-dev/tessera/driver/fakenode"
	"github.com/tessera-dev/tessera/driver/inventory"
	"github.com/tessera-dev/tessera/driver/mig"
	"github.com/tessera-dev/tessera/driver/simulate"
	"github.com/tessera-dev/tessera/driver/slices"
	"github.com/tessera-dev/tessera/test/fixtures"
)

func migCluster(t *testing.T, p fakenode.Profile, order inventory.Order) (*simulate.Cluster, []*resourceapi.ResourceSlice) {
	t.Helper()
	sl := publishedWith(t, p, true, order)
	classes, err := deviceclass.All()
	if err != nil {
		t.Fatal(err)
	}
	return simulate.New(classes, sl), sl
}

func profileClaim(profile string) *resourceapi.ResourceClaim {
	c := claim(request{count: 1})
	c.Spec.Devices.Requests[0].Exactly.DeviceClassName = "mig.gpu.tessera.dev"
	c.Spec.Devices.Requests[0].Exactly.Selectors = []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{
		Expression: fmt.Sprintf(`device.attributes["gpu.tessera.dev"].profile == %q`, profile),
	}}}
	return c
}

func wholeClaim() *resourceapi.ResourceClaim { return claim(request{count: 1}) }

// oneGPU trims a profile to its first GPU.
func oneGPU(t *testing.T, name string) fakenode.Profile {
	p := profile(t, name)
	p.GPUs = p.GPUs[:1]
	p.NVLinkIslands = nil
	return p
}

func migProfiles(sl []*resourceapi.ResourceSlice) map[string]bool {
	out := map[string]bool{}
	for _, s := range sl {
		for _, d := range s.Spec.Devices {
			if a, ok := d.Attributes[slices.AttrProfile]; ok {
				out[*a.StringValue] = true
			}
		}
	}
	return out
}

func TestEveryMIGProfileIsAllocatable(t *testing.T) {
	a100 := profile(t, "dgx-a100")
	a100.MIGEnabled = []int{0, 1, 2, 3, 4, 5, 6, 7} // Ampere offers partitions only in MIG mode
	for name, p := range map[string]fakenode.Profile{"dgx-h100": profile(t, "dgx-h100"), "dgx-a100": a100, "dgx-b200": profile(t, "dgx-b200")} {
		t.Run(name, func(t *testing.T) {
			c, sl := migCluster(t, p, inventory.Pack)
			profiles := migProfiles(sl)
			if len(profiles) < 5 {
				t.Fatalf("only %d MIG profiles published: %v", len(profiles), profiles)
			}
			for prof := range profiles {
				if res := allocate(t, c, profileClaim(prof)); res == nil {
					t.Errorf("profile %s not allocatable on an empty node", prof)
				}
			}
		})
	}
}

type placed struct {
	gpu        string
	start, end int64
	whole      bool
}

func placementsOf(sl []*resourceapi.ResourceSlice) map[string]placed {
	out := map[string]placed{}
	for _, s := range sl {
		for _, d := range s.Spec.Devices {
			a := d.Attributes
			if *a[slices.AttrType].StringValue == slices.TypeGPU {
				out[d.Name] = placed{gpu: d.Name, whole: true}
				continue
			}
			start := *a[slices.AttrPlacementStart].IntValue
			out[d.Name] = placed{gpu: fmt.Sprintf("gpu-%d", *a[slices.AttrParentIndex].IntValue), start: start, end: start + *a[slices.AttrPlacementSize].IntValue}
		}
	}
	return out
}

func TestOverlappingPlacementsAreNeverBothAllocated(t *testing.T) {
	c, sl := migCluster(t, oneGPU(t, "dgx-h100"), inventory.Pack)
	where := placementsOf(sl)
	var held []placed
	// Ask for profiles large to small and back until nothing fits.
	for _, prof := range []string{"3g.40gb", "2g.20gb", "1g.10gb", "1g.20gb", "4g.40gb", "1g.10gb", "7g.80gb", "1g.10gb+me", "1g.10gb", "2g.20gb", "1g.10gb", "1g.10gb"} {
		res := allocate(t, c, profileClaim(prof))
		if res == nil {
			continue
		}
		c.Commit(res...)
		held = append(held, where[res[0].Devices.Results[0].Device])
	}
	if res := allocate(t, c, wholeClaim()); res != nil {
		t.Errorf("whole GPU allocated while %d partitions hold it", len(held))
	}
	for i := range held {
		for j := i + 1; j < len(held); j++ {
			if held[i].start < held[j].end && held[j].start < held[i].end {
				t.Errorf("overlapping placements allocated: %+v and %+v", held[i], held[j])
			}
		}
	}
	if len(held) < 4 {
		t.Errorf("only %d partitions placed on an empty H100: %+v", len(held), held)
	}
}

func TestWholeGPUAndPartitionsExcludeEachOther(t *testing.T) {
	c, _ := migCluster(t, oneGPU(t, "dgx-h100"), inventory.Pack)
	whole := allocate(t, c, wholeClaim())
	if whole == nil {
		t.Fatal("whole GPU not allocatable")
	}
	c.Commit(whole...)
	if res := allocate(t, c, profileClaim("1g.10gb")); res != nil {
		t.Fatalf("partition allocated on a GPU held whole: %v", res[0].Devices.Results)
	}
	c.Release(whole...)
	part := allocate(t, c, profileClaim("1g.10gb"))
	if part == nil {
		t.Fatal("partition not allocatable after the whole GPU was released")
	}
	c.Commit(part...)
	if res := allocate(t, c, wholeClaim()); res != nil {
		t.Fatalf("whole GPU allocated while a partition holds it: %v", res[0].Devices.Results)
	}
}

// TestPackingKeepsWholeGPUsFree runs one sequence of mixed MIG claims and
// releases against Tessera's layout and a naive one, with the real allocator,
// and counts the GPUs left with no partition.
func TestPackingKeepsWholeGPUsFree(t *testing.T) {
	free := func(order inventory.Order) int {
		c, sl := migCluster(t, profile(t, "dgx-h100"), order)
		where := placementsOf(sl)
		var held [][]resourceapi.AllocationResult
		take := func(prof string, n int) {
			for range n {
				res := allocate(t, c, profileClaim(prof))
				if res == nil {
					t.Fatalf("%s did not fit", prof)
				}
				c.Commit(res...)
				held = append(held, res)
			}
		}
		take("1g.10gb", 9)
		take("2g.20gb", 3)
		take("3g.40gb", 2)
		for i := 0; i < len(held); i += 3 { // every third job ends
			c.Release(held[i]...)
			held[i] = nil
		}
		take("1g.10gb", 5)
		used := map[string]bool{}
		for _, r := range held {
			if r != nil {
				used[where[r[0].Devices.Results[0].Device].gpu] = true
			}
		}
		// Cross-check with the allocator: that many whole GPUs must fit.
		n := 8 - len(used)
		if n > 0 {
			if res := allocate(t, c, claim(request{count: int64(n)})); res == nil {
				t.Errorf("%d whole GPUs should be free but do not fit", n)
			}
		}
		return n
	}
	packed, spread := free(inventory.Pack), free(inventory.Spread)
	t.Logf("whole GPUs left free after the same MIG sequence: Tessera layout %d, naive layout %d", packed, spread)
	if packed <= spread {
		t.Errorf("packing left %d whole GPUs free, the naive layout %d", packed, spread)
	}
}

func TestMIGLayoutRespectsAPILimits(t *testing.T) {
	for _, name := range fakenode.Profiles() {
		p := profile(t, name)
		if name == "dgx-a100" {
			p.MIGEnabled = []int{0, 1, 2, 3, 4, 5, 6, 7}
		}
		sl := publishedWith(t, p, true, inventory.Pack)
		for _, s := range sl {
			if len(s.Spec.SharedCounters) > 0 && len(s.Spec.Devices) > 0 {
				t.Errorf("%s: slice %s mixes devices and counters", name, s.Name)
			}
			if len(s.Spec.SharedCounters) > slices.MaxCounterSetsPerSlice {
				t.Errorf("%s: %d counter sets in one slice", name, len(s.Spec.SharedCounters))
			}
			for _, cs := range s.Spec.SharedCounters {
				if len(cs.Counters) == 0 || len(cs.Counters) > slices.MaxCountersPerSet {
					t.Errorf("%s: counter set %s has %d counters", name, cs.Name, len(cs.Counters))
				}
			}
			limit := slices.MaxDevicesPerSlice
			for _, d := range s.Spec.Devices {
				if len(d.ConsumesCounters) > 0 {
					limit = slices.MaxDevicesPerSliceWithCounters
				}
				if n := len(d.Attributes) + len(d.Capacity); n > slices.MaxAttributesAndCapacities {
					t.Errorf("%s: %s has %d attributes and capacities", name, d.Name, n)
				}
				if len(d.ConsumesCounters) > 2 {
					t.Errorf("%s: %s consumes %d counter sets", name, d.Name, len(d.ConsumesCounters))
				}
			}
			if len(s.Spec.Devices) > limit {
				t.Errorf("%s: slice %s has %d devices, limit %d", name, s.Name, len(s.Spec.Devices), limit)
			}
		}
	}
}

func TestGPUsWithoutMIGNeverGetCounterSets(t *testing.T) {
	for _, name := range []string{"pcie-l4x4", "dgx-a100"} { // no MIG; Ampere not in MIG mode
		for _, s := range publishedWith(t, profile(t, name), true, inventory.Pack) {
			if len(s.Spec.SharedCounters) > 0 {
				t.Errorf("%s publishes counter sets %v", name, s.Spec.SharedCounters)
			}
			for _, d := range s.Spec.Devices {
				if len(d.ConsumesCounters) > 0 {
					t.Errorf("%s: %s consumes counters", name, d.Name)
				}
			}
		}
	}
}

func TestAmpereInMIGModeOffersPartitionsButNotTheWholeGPU(t *testing.T) {
	p := profile(t, "dgx-a100")
	p.MIGEnabled = []int{0}
	names := map[string]bool{}
	for _, s := range publishedWith(t, p, true, inventory.Pack) {
		for _, d := range s.Spec.Devices {
			names[d.Name] = true
		}
	}
	if names["gpu-0"] || !names["gpu-1"] || !names["gpu-0-mig-1g5gb-0"] {
		t.Errorf("want gpu-0 partitions only and gpu-1 whole; got gpu-0:%v gpu-1:%v gpu-0-mig-1g5gb-0:%v", names["gpu-0"], names["gpu-1"], names["gpu-0-mig-1g5gb-0"])
	}
}

func TestStaticMIGPublishesTheOperatorsDevices(t *testing.T) {
	p := profile(t, "dgx-a100")
	p.MIGInstances = map[int][]fakenode.StaticInstance{0: {{Index: 0, Start: 0}, {Index: 0, Start: 1}, {Index: 2, Start: 4}}}
	sl := publishedWith(t, p, false, inventory.Pack)
	var migs []resourceapi.Device
	for _, s := range sl {
		for _, d := range s.Spec.Devices {
			if *d.Attributes[slices.AttrType].StringValue == slices.TypeMIG {
				migs = append(migs, d)
			}
			if d.Name == "gpu-0" {
				t.Error("a GPU in MIG mode is offered whole")
			}
			if len(d.ConsumesCounters) > 0 {
				t.Errorf("static MIG device %s consumes counters", d.Name)
			}
		}
	}
	if len(migs) != 3 {
		t.Fatalf("%d MIG devices, want 3", len(migs))
	}
	for _, d := range migs {
		a := d.Attributes
		if a[slices.AttrUUID].StringValue == nil || a[slices.AttrParentUUID].StringValue == nil || a[slices.AttrProductName].StringValue == nil {
			t.Errorf("%s lacks uuid, parentUUID or productName: %v", d.Name, a)
		}
		if _, ok := d.Capacity[slices.CapMultiprocessors]; !ok {
			t.Errorf("%s lacks the multiprocessors capacity", d.Name)
		}
	}
	if *migs[2].Attributes[slices.AttrProfile].StringValue != "3g.20gb" {
		t.Errorf("third device profile %s", *migs[2].Attributes[slices.AttrProfile].StringValue)
	}
}

// TestLeftOutEngineCountersNeverRefuseAnything walks every combination of
// partitions on disjoint memory slices of each MIG-capable fixture and
// checks that the engine counters Tessera publishes refuse exactly the
// combinations the full set of engine counters would: the ones left out
// never bind. It also checks that some were left out, since that is what
// makes a dynamic-MIG node cheaper for the scheduler to try.
func TestLeftOutEngineCountersNeverRefuseAnything(t *testing.T) {
	for _, name := range []string{"dgx-a100", "dgx-h100", "dgx-h200", "dgx-b200", "gb200-nvl72-tray"} {
		t.Run(name, func(t *testing.T) {
			_, gpus := fixtures.Node(t, profile(t, name), node)
			info := gpus[0].MIG
			if info == nil {
				t.Fatalf("%s: GPU 0 has no MIG facts", name)
			}
			totals, limits := slices.EngineTotals(info), slices.EngineLimits(info)
			if len(limits) >= len(totals) {
				t.Errorf("%s: all %d engine counters kept (%v); expected the ones that never bind left out", name, len(totals), limits)
			}
			type part struct {
				start, size int
				engines     map[string]int
			}
			var parts []part
			for _, p := range info.Profiles {
				for _, pl := range p.Placements {
					parts = append(parts, part{pl.Start, pl.Size, slices.Engines(p)})
				}
			}
			within := func(used, caps map[string]int) bool {
				for e, n := range used {
					if c, ok := caps[e]; ok && n > c {
						return false
					}
				}
				return true
			}
			combos, refused := 0, 0
			var walk func(i int, taken uint64, used map[string]int)
			walk = func(i int, taken uint64, used map[string]int) {
				if i == len(parts) {
					combos++
					full, published := within(used, totals), within(used, limits)
					if !full {
						refused++
					}
					if full != published {
						t.Fatalf("%s: combination using %v: full counters admit it %v, published ones %v", name, used, full, published)
					}
					return
				}
				walk(i+1, taken, used)
				p := parts[i]
				mask := uint64(1)<<(p.start+p.size) - uint64(1)<<p.start
				if taken&mask != 0 {
					return
				}
				next := map[string]int{}
				for e, n := range used {
					next[e] = n
				}
				for e, n := range p.engines {
					next[e] += n
				}
				walk(i+1, taken|mask, next)
			}
			walk(0, 0, map[string]int{})
			t.Logf("%s: %d combinations on disjoint memory slices, %d refused by engine counters; engine counters %d of %d kept", name, combos, refused, len(limits), len(totals))
		})
	}
}

// TestNoGPUHoldsMoreInstancesOfAProfileThanNVMLAllows fills one GPU of each
// MIG fixture with one profile at a time, committing each allocation, and
// checks the scheduler hands out exactly as many as NVML would create: the
// most placements that do not overlap, capped by the profile's instance
// count. Every board reports its +me profile (one OFA engine) at seven
// placements but one instance.
func TestNoGPUHoldsMoreInstancesOfAProfileThanNVMLAllows(t *testing.T) {
	capped := 0
	for _, name := range []string{"dgx-a100", "dgx-a100-80gb", "dgx-h100", "dgx-h200", "dgx-b200", "gb200-nvl72-tray"} {
		p := oneGPU(t, name)
		p.MIGEnabled = []int{0} // Ampere offers partitions only in MIG mode
		_, gpus := fixtures.Node(t, p, node)
		for _, prof := range gpus[0].MIG.Profiles {
			// The most placements that do not overlap, by trying every subset.
			disjoint := 0
			pls := prof.Placements
			for set := 0; set < 1<<len(pls); set++ {
				var used uint64
				n, ok := 0, true
				for i, pl := range pls {
					if set&(1<<i) == 0 {
						continue
					}
					mask := uint64(1)<<(pl.Start+pl.Size) - uint64(1)<<pl.Start
					ok = ok && used&mask == 0
					used |= mask
					n++
				}
				if ok {
					disjoint = max(disjoint, n)
				}
			}
			want := min(disjoint, prof.MaxInstances)
			if want < disjoint {
				capped++
			}
			c, _ := migCluster(t, p, inventory.Pack)
			got := 0
			for got <= disjoint {
				res := allocate(t, c, profileClaim(prof.Name))
				if res == nil {
					break
				}
				c.Commit(res...)
				got++
			}
			if got != want {
				t.Errorf("%s: %d instances of %s allocated on one GPU, NVML allows %d (%d placements side by side, instance count %d)",
					name, got, prof.Name, want, disjoint, prof.MaxInstances)
			}
		}
	}
	if capped == 0 {
		t.Error("no fixture has a profile capped by its instance count: the test no longer covers the case it was written for")
	}
}

// TestPublishingRefusesDuplicateNames: should two MIG profiles of a GPU ever
// fold to one label, publishing fails with the two names instead of sending
// the API server two devices (and one instance counter) under one name.
func TestPublishingRefusesDuplicateNames(t *testing.T) {
	_, gpus := fixtures.Node(t, oneGPU(t, "dgx-h100"), node)
	info := *gpus[0].MIG
	info.Profiles = append([]mig.Profile(nil), info.Profiles...)
	for i, p := range info.Profiles {
		if p.Name == "1g.10gb+me" {
			info.Profiles[i].Name = "1g.10gb.me" // folds onto 1g.10gb+me's label
			info.Profiles = append(info.Profiles, p)
			break
		}
	}
	gpus[0].MIG = &info
	_, err := slices.Build(node, inventory.Build(gpus, inventory.Options{DynamicMIG: true}), slices.Options{})
	if err == nil || !strings.Contains(err.Error(), "1g.10gb+me") || !strings.Contains(err.Error(), "1g.10gb.me") {
		t.Fatalf("Build with two profiles folding to one label: err = %v, want one naming both", err)
	}
}

// TestPackListsWholeGPUsThenEachProfileAcrossGPUs pins the device order the
// scheduler meets on a dynamic-MIG node: the whole GPUs first, then each
// profile's partitions together, GPU by GPU. Its allocator tries devices
// first-fit and evaluates CEL on each one it meets before a free one; with
// each GPU's devices together, a pod asking for a whole GPU paid for every
// partition of every used GPU, and a 1g pod for every other profile of every
// GPU whose 1g placements were taken, on every node it tried
// (BenchmarkSchedulerThroughput, cases migwhole and mig1g). The order among
// one profile's devices, and so what a one-profile request gets, is
// unchanged (TestPackingKeepsWholeGPUsFree).
func TestPackListsWholeGPUsThenEachProfileAcrossGPUs(t *testing.T) {
	sl := publishedWith(t, profile(t, "dgx-h100"), true, inventory.Pack)
	sort.Slice(sl, func(i, j int) bool { return sl[i].Name < sl[j].Name })
	where := placementsOf(sl)
	var order []string // "" for whole GPUs, else the profile, as met
	lastGPU := map[string]string{}
	for _, s := range sl {
		for _, d := range s.Spec.Devices {
			group := ""
			if a, ok := d.Attributes[slices.AttrProfile]; ok {
				group = *a.StringValue
			}
			if len(order) == 0 || order[len(order)-1] != group {
				if slicesContain(order, group) {
					t.Fatalf("%s devices are not together: %s comes after %v", group, d.Name, order)
				}
				order = append(order, group)
			}
			gpu := d.Name
			if group != "" {
				gpu = where[d.Name].gpu
			}
			if gpu < lastGPU[group] {
				t.Fatalf("%s comes after a device of %s", d.Name, lastGPU[group])
			}
			lastGPU[group] = gpu
		}
	}
	if len(order) < 2 || order[0] != "" {
		t.Fatalf("want the whole GPUs first, then profiles; got groups %q", order)
	}
}

func slicesContain(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}
