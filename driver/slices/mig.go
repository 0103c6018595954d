package slices

import (
	"fmt"
	"sort"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/tessera-dev/tessera/driver/inventory"
	"github.com/tessera-dev/tessera/driver/mig"
)

// MIG device attribute and capacity names.
const (
	TypeMIG            = "mig"
	AttrProfile        = "profile"
	AttrParentUUID     = "parentUUID"
	AttrParentIndex    = "parentIndex"
	AttrPlacementStart = "placementStart"
	AttrPlacementSize  = "placementSize"
	AttrComputeSlices  = "computeSlices"
	CapMultiprocessors = "multiprocessors"
	CapCopyEngines     = "copyEngines"
	CapDecoders        = "decoders"
	CapEncoders        = "encoders"
	CapJPEGEngines     = "jpegEngines"
	CapOFAEngines      = "ofaEngines"
	counterMultiprocs  = "multiprocessors"
	counterCopyEngines = "copy-engines"
	counterDecoders    = "decoders"
	counterEncoders    = "encoders"
	counterJPEGEngines = "jpeg-engines"
	counterOFAEngines  = "ofa-engines"
	counterMemorySlice = "memory-slice-%d"
	counterInstances   = "instances-%s"
	// counterWithdrawing has no room (0) in a lazily published GPU's
	// counter set, and each partition being withdrawn consumes 1 of it:
	// no claim can be allocated one, whatever taints it tolerates
	// (driver/lazymig, lazily).
	counterWithdrawing = "withdrawing"
)

// MIGDevice is the published form of a MIG partition or static MIG device:
// its parent's identity and topology, its profile and placement, and what it
// holds as capacities.
func MIGDevice(d inventory.Device) resourceapi.Device {
	g, p := d.GPU, d.Profile
	attrs := gpuAttributes(g)
	attrs[AttrType] = str(TypeMIG)
	attrs[AttrProfile] = str(p.Name)
	attrs[AttrParentUUID] = str(g.UUID)
	attrs[AttrParentIndex] = integer(int64(g.Index))
	attrs[AttrPlacementStart] = integer(int64(d.Placement.Start))
	attrs[AttrPlacementSize] = integer(int64(d.Placement.Size))
	attrs[AttrComputeSlices] = integer(int64(p.Slices))
	if d.Instance != nil && d.Instance.UUID != "" {
		attrs[AttrUUID] = str(d.Instance.UUID)
	}
	q := func(n int) resourceapi.DeviceCapacity {
		return resourceapi.DeviceCapacity{Value: *resource.NewQuantity(int64(n), resource.DecimalSI)}
	}
	return resourceapi.Device{
		Name:       d.Name,
		Attributes: attrs,
		Capacity: map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{
			CapMemory:          {Value: *resource.NewQuantity(p.MemoryBytes, resource.BinarySI)},
			CapMultiprocessors: q(p.Multiprocessors),
			CapCopyEngines:     q(p.CopyEngines),
			CapDecoders:        q(p.Decoders),
			CapEncoders:        q(p.Encoders),
			CapJPEGEngines:     q(p.JPEGs),
			CapOFAEngines:      q(p.OFAs),
		},
	}
}

// engines are a profile's engine counts by counter name.
func engines(p mig.Profile) map[string]int {
	return map[string]int{
		counterMultiprocs: p.Multiprocessors, counterCopyEngines: p.CopyEngines, counterDecoders: p.Decoders,
		counterEncoders: p.Encoders, counterJPEGEngines: p.JPEGs, counterOFAEngines: p.OFAs,
	}
}

// consumption is what a device takes from its GPU's counter set: the memory
// slices it occupies (all of them for the whole GPU) and, for partitions,
// its engines and its profile's instances where the set limits them
// (counterLimits of the GPU).
func consumption(d inventory.Device, limits map[string]int) map[string]resourceapi.Counter {
	out := map[string]resourceapi.Counter{}
	one := resourceapi.Counter{Value: *resource.NewQuantity(1, resource.DecimalSI)}
	if d.Kind == inventory.Whole {
		for i := 0; i < d.GPU.MIG.MemorySlices; i++ {
			out[fmt.Sprintf(counterMemorySlice, i)] = one
		}
		return out
	}
	for i := d.Placement.Start; i < d.Placement.Start+d.Placement.Size; i++ {
		out[fmt.Sprintf(counterMemorySlice, i)] = one
	}
	for name, n := range engines(d.Profile) {
		if _, binds := limits[name]; binds && n > 0 {
			out[name] = resourceapi.Counter{Value: *resource.NewQuantity(int64(n), resource.DecimalSI)}
		}
	}
	if name := instanceCounter(d.Profile); limits[name] > 0 {
		out[name] = one
	}
	return out
}

// counterSets are the GPUs' shared counters: one per memory slice, and the
// engine and instance limits of counterLimits, so the scheduler refuses
// exactly the combinations NVML would; published lazily, the GPUs whose
// partitions can be withdrawn also hold counterWithdrawing, at 0.
func counterSets(inv *inventory.Inventory, limits limitsByGPU, withdrawable map[string]bool) []resourceapi.CounterSet {
	var out []resourceapi.CounterSet
	for _, g := range inv.CounterSets {
		counters := map[string]resourceapi.Counter{}
		for i := 0; i < g.MIG.MemorySlices; i++ {
			counters[fmt.Sprintf(counterMemorySlice, i)] = resourceapi.Counter{Value: *resource.NewQuantity(1, resource.DecimalSI)}
		}
		for name, n := range limits.of(g.MIG) {
			counters[name] = resourceapi.Counter{Value: *resource.NewQuantity(int64(n), resource.DecimalSI)}
		}
		if withdrawable[g.Name()] {
			counters[counterWithdrawing] = resourceapi.Counter{Value: *resource.NewQuantity(0, resource.DecimalSI)}
		}
		out = append(out, resourceapi.CounterSet{Name: inventory.CounterSetName(g), Counters: counters})
	}
	return out
}

// sideBySide is how many instances of a profile fit on a GPU at once: its
// non-overlapping placements, capped by the profile's instance count.
func sideBySide(p mig.Profile) int {
	n := disjointPlacements(p)
	if p.MaxInstances > 0 {
		n = min(n, p.MaxInstances)
	}
	return n
}

// disjointPlacements is the most placements of a profile that do not
// overlap (earliest end first).
func disjointPlacements(p mig.Profile) int {
	end, n := -1, 0
	pls := append([]mig.Placement(nil), p.Placements...)
	sort.Slice(pls, func(i, j int) bool { return pls[i].Start+pls[i].Size < pls[j].Start+pls[j].Size })
	for _, pl := range pls {
		if pl.Start >= end {
			n++
			end = pl.Start + pl.Size
		}
	}
	return n
}

// counterLimits are the counters a GPU's counter set holds besides its
// memory slices: engineLimits and instanceLimits.
func counterLimits(info *mig.Info) map[string]int {
	limits := engineLimits(info)
	for name, n := range instanceLimits(info) {
		limits[name] = n
	}
	return limits
}

// limitsByGPU memoizes counterLimits per GPU for one Build: its devices and
// its counter set need the same limits.
type limitsByGPU map[*mig.Info]map[string]int

func (l limitsByGPU) of(info *mig.Info) map[string]int {
	out, ok := l[info]
	if !ok {
		out = counterLimits(info)
		l[info] = out
	}
	return out
}

// instanceCounter names the counter that caps a profile's instances.
func instanceCounter(p mig.Profile) string {
	return fmt.Sprintf(counterInstances, inventory.ProfileLabel(p.Name))
}

// instanceLimits are the per-profile instance counters: one for each profile
// whose instance count (NVML's InstanceCount) is below how many of its
// placements fit side by side, which the memory slices alone would allow.
// Every MIG board reports its +me profile (1g.10gb+me on an H100) at seven
// placements with one instance, the one OFA engine; without a cap the
// scheduler would hand out a second that NVML refuses at prepare, leaving
// the pod stuck on its node (here the OFA engine counter already binds the
// same way). Profiles whose placements already bound them get none: it would
// never refuse anything.
func instanceLimits(info *mig.Info) map[string]int {
	limits := map[string]int{}
	if info == nil {
		return limits
	}
	for _, p := range info.Profiles {
		if p.MaxInstances > 0 && p.MaxInstances < disjointPlacements(p) {
			limits[instanceCounter(p)] = p.MaxInstances
		}
	}
	return limits
}

// engineLimits are the engine counters a GPU's counter set holds: the
// engineTotals, each left out where no combination of partitions on disjoint
// memory slices can exceed it. Such a counter never refuses anything the
// memory slices allow, yet the scheduler would check it for every device on
// every node it tries (two thirds of a dynamic-MIG node's counters were of
// this kind), so leaving it out changes no allocation and makes each one
// cheaper.
func engineLimits(info *mig.Info) map[string]int {
	limits := engineTotals(info)
	for name, limit := range limits {
		if limit == 0 || mostOnDisjointSlices(info, name) <= limit {
			delete(limits, name)
		}
	}
	return limits
}

// engineTotals are, per engine, the most any valid combination of
// partitions can use: a profile's count times how many of it fit side by side.
func engineTotals(info *mig.Info) map[string]int {
	totals := map[string]int{}
	if info == nil {
		return totals
	}
	for _, p := range info.Profiles {
		side := sideBySide(p)
		for name, n := range engines(p) {
			totals[name] = max(totals[name], n*side)
		}
	}
	return totals
}

// mostOnDisjointSlices is the most of one engine that partitions placed on
// disjoint memory slices can hold together: the best sum over placements
// that do not overlap, found slice by slice from the last one back.
func mostOnDisjointSlices(info *mig.Info, engine string) int {
	type span struct{ size, n int }
	starting := make([][]span, info.MemorySlices) // placements by first slice
	for _, p := range info.Profiles {
		n := engines(p)[engine]
		for _, pl := range p.Placements {
			if pl.Start >= 0 && pl.Size > 0 && pl.Start+pl.Size <= info.MemorySlices {
				starting[pl.Start] = append(starting[pl.Start], span{pl.Size, n})
			}
		}
	}
	best := make([]int, info.MemorySlices+1) // best[i]: using slices i and above
	for i := info.MemorySlices - 1; i >= 0; i-- {
		best[i] = best[i+1]
		for _, sp := range starting[i] {
			best[i] = max(best[i], sp.n+best[i+sp.size])
		}
	}
	return best[0]
}
