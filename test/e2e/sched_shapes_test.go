package e2e

import (
	"slices"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/resourceslice"

	tslices "github.com/tessera-dev/tessera/driver/slices"
	"github.com/tessera-dev/tessera/test/fixtures"
)

// Shapes BenchmarkSchedulerThroughput weighs as levers against the layout
// the plugin publishes (docs/performance.md, "Scale"). Each takes one node's
// published slices (one pool, device slices then counter slices) and returns
// the same pool laid out otherwise, named and counted as the plugin's slice
// controller would.

// alignedShape keeps each GPU's devices (whole and partitions) in one slice,
// two GPUs a slice, each slice's whole GPUs first and then its partitions in
// the published order (profile by profile): a health taint on one GPU then
// changes one slice, which the upstream slice controller writes alone.
func alignedShape(t testing.TB, pool []*resourceapi.ResourceSlice) []*resourceapi.ResourceSlice {
	devices, counters := split(pool)
	var gpus []string
	byGPU := map[string][]resourceapi.Device{}
	for _, d := range devices {
		if len(d.ConsumesCounters) == 0 {
			t.Fatalf("device %s draws on no counter set: not a dynamic-MIG node", d.Name)
		}
		g := d.ConsumesCounters[0].CounterSet
		if _, seen := byGPU[g]; !seen {
			gpus = append(gpus, g)
		}
		byGPU[g] = append(byGPU[g], d)
	}
	var groups [][]resourceapi.Device
	for pair := range slices.Chunk(gpus, 2) {
		var whole, parts []resourceapi.Device
		for _, g := range pair {
			for _, d := range byGPU[g] {
				if isPartition(d) {
					parts = append(parts, d)
				} else {
					whole = append(whole, d)
				}
			}
		}
		// Partitions in published order: profile by profile across the pair.
		slices.SortStableFunc(parts, func(a, b resourceapi.Device) int {
			return index(devices, a.Name) - index(devices, b.Name)
		})
		group := append(whole, parts...)
		if len(group) > tslices.MaxDevicesPerSliceWithCounters {
			t.Fatalf("two GPUs' devices (%d) exceed one slice", len(group))
		}
		groups = append(groups, group)
	}
	return reslice(pool, groups, counters)
}

func isPartition(d resourceapi.Device) bool {
	a, ok := d.Attributes[tslices.AttrType]
	return ok && a.StringValue != nil && *a.StringValue != tslices.TypeGPU
}

func index(devices []resourceapi.Device, name string) int {
	return slices.IndexFunc(devices, func(d resourceapi.Device) bool { return d.Name == name })
}

// split returns a pool's devices in published order and its counter sets.
func split(pool []*resourceapi.ResourceSlice) ([]resourceapi.Device, []resourceapi.CounterSet) {
	var devices []resourceapi.Device
	var counters []resourceapi.CounterSet
	for _, s := range pool {
		devices = append(devices, s.Spec.Devices...)
		counters = append(counters, s.Spec.SharedCounters...)
	}
	return devices, counters
}

// reslice lays out device groups, one slice each, then the counter sets,
// as slices.Objects names them for the pool's node.
func reslice(pool []*resourceapi.ResourceSlice, groups [][]resourceapi.Device, counters []resourceapi.CounterSet) []*resourceapi.ResourceSlice {
	node := *pool[0].Spec.NodeName
	var out []resourceslice.Slice
	for _, g := range groups {
		out = append(out, resourceslice.Slice{Devices: g})
	}
	for sets := range slices.Chunk(counters, tslices.MaxCounterSetsPerSlice) {
		out = append(out, resourceslice.Slice{SharedCounters: sets})
	}
	res := resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{pool[0].Spec.Pool.Name: {Slices: out}}}
	var objs []*resourceapi.ResourceSlice
	for _, s := range tslices.Objects(node, res) {
		objs = append(objs, &s)
	}
	return objs
}

// TestTheLeverShapes checks what the lazy cases and the lever publish for a
// DGX H100 against counts worked out from the node published with every
// partition (eight GPUs, each with its whole device and its partitions), not
// from the shapes' own code.
func TestTheLeverShapes(t *testing.T) {
	gpus := discoverSimNodes(t, 1)[0]
	pool := fixtures.Published(t, simNodeName(0), gpus, dynamicMIG(t))
	perGPU := map[string]int{} // devices drawing on each GPU's counter set
	for _, s := range pool {
		for _, d := range s.Spec.Devices {
			perGPU[d.ConsumesCounters[0].CounterSet]++
		}
	}
	if len(perGPU) != 8 {
		t.Fatalf("the node has %d counter sets, want 8", len(perGPU))
	}
	gpuOf := func(d resourceapi.Device) string { return d.ConsumesCounters[0].CounterSet }
	check := func(t *testing.T, shaped []*resourceapi.ResourceSlice, wantDeviceSlices int) {
		t.Helper()
		var deviceSlices, counterSets int
		for _, s := range shaped {
			if s.Spec.Pool.ResourceSliceCount != int64(len(shaped)) || s.Spec.Pool.Name != pool[0].Spec.Pool.Name {
				t.Errorf("slice %s: pool %s of %d slices, want %s of %d", s.Name, s.Spec.Pool.Name, s.Spec.Pool.ResourceSliceCount, pool[0].Spec.Pool.Name, len(shaped))
			}
			counterSets += len(s.Spec.SharedCounters)
			if len(s.Spec.Devices) > 0 {
				deviceSlices++
			}
		}
		if deviceSlices != wantDeviceSlices || counterSets != 8 {
			t.Errorf("%d device slices and %d counter sets, want %d and 8", deviceSlices, counterSets, wantDeviceSlices)
		}
	}

	t.Run("lazy", func(t *testing.T) {
		// What the lazy cases publish: the whole GPUs, of which only the
		// spare (gpu-7) draws on counters, the spare's partitions, and
		// every counter set.
		shaped := fixtures.PublishedLazily(t, simNodeName(0), gpus, dynamicMIG(t))
		var sets []string
		whole, counted, parts := 0, map[string]bool{}, map[string]int{}
		for _, s := range shaped {
			for _, c := range s.Spec.SharedCounters {
				sets = append(sets, c.Name)
			}
			for i, d := range s.Spec.Devices {
				if isPartition(d) {
					parts[gpuOf(d)]++
					continue
				}
				if whole++; whole != i+1 {
					t.Errorf("whole GPU %s listed after a partition", d.Name)
				}
				if len(d.ConsumesCounters) > 0 {
					counted[d.Name] = true
				}
			}
		}
		if len(shaped) != 2 || whole != 8 || len(parts) != 1 || parts["gpu-7"] != perGPU["gpu-7"]-1 {
			t.Errorf("%d slices, %d whole GPUs and partitions %v: want 2 slices, 8 whole GPUs and gpu-7's %d partitions", len(shaped), whole, parts, perGPU["gpu-7"]-1)
		}
		if len(sets) != 8 || len(counted) != 1 || !counted["gpu-7"] {
			t.Errorf("counter sets %v, whole GPUs drawing on counters %v: want all 8 sets, and gpu-7 alone drawing on one", sets, counted)
		}
	})
	t.Run("aligned", func(t *testing.T) {
		shaped := alignedShape(t, pool)
		check(t, shaped, 4)
		for _, s := range shaped[:4] {
			gpus := map[string]int{}
			for _, d := range s.Spec.Devices {
				gpus[gpuOf(d)]++
			}
			for g, n := range gpus {
				if n != perGPU[g] {
					t.Errorf("slice %s holds %d of %s's %d devices", s.Name, n, g, perGPU[g])
				}
			}
			if len(gpus) != 2 || isPartition(s.Spec.Devices[0]) || isPartition(s.Spec.Devices[1]) {
				t.Errorf("slice %s: GPUs %v, first devices %s and %s: want two GPUs, their whole devices first", s.Name, gpus, s.Spec.Devices[0].Name, s.Spec.Devices[1].Name)
			}
		}
	})
}
