// Package inventory decides what a node hands out: for each GPU, the whole
// GPU, its MIG partitions (every profile at every valid placement, created on
// demand), or the MIG devices an operator made, and in which order the
// scheduler should meet them. Slices render it; prepare resolves names in it.
package inventory

import (
	"fmt"
	"regexp"
	"slices"
	"strings"

	"github.com/tessera-dev/tessera/driver/discovery"
	"github.com/tessera-dev/tessera/driver/mig"
)

// Kind is what a published device is.
type Kind int

const (
	// Whole is a whole GPU.
	Whole Kind = iota
	// Partition is a MIG partition Tessera creates at prepare and destroys
	// at unprepare (dynamic MIG).
	Partition
	// StaticMIG is a MIG device that existed before Tessera started.
	StaticMIG
)

// Device is one device a node publishes.
type Device struct {
	Name string
	Kind Kind
	GPU  discovery.GPU
	// Partition and StaticMIG devices:
	Profile   mig.Profile
	Placement mig.Placement
	// Instance is set for StaticMIG devices.
	Instance *mig.Instance
	// Counters is the GPU's counter set name, set when the device consumes
	// counters (dynamic MIG).
	Counters string
	// Share says how independent claims share a whole GPU; zero for a GPU
	// one claim takes.
	Share Share
}

// Share is how several claims may hold one whole GPU at once.
type Share struct {
	// TimeSlices: this many claims may each take a slice (time-slicing).
	TimeSlices int
	// Memory: claims each take a part of the GPU's memory.
	Memory bool
}

// Shared says whether claims share the GPU.
func (s Share) Shared() bool { return s.TimeSlices > 0 || s.Memory }

// Order says how devices are laid out for the scheduler's first-fit search.
type Order int

const (
	// Pack lists the whole GPUs first, then the partitions profile by
	// profile, each profile's on every GPU in index order, from the highest
	// placement down: for any one profile the scheduler meets a GPU already
	// in use before it opens another, and keeps low, large placements and
	// whole GPUs free. The grouping is for the scheduler's cost: its
	// allocator evaluates CEL on every device it meets before a free one
	// (~10 us each), so a whole-GPU pod listed after every GPU's partitions,
	// or a 1g pod after a used GPU's other profiles, paid for all of them on
	// every node it tried. A request for one profile (or a whole GPU) gets
	// the device it got with each GPU's devices kept together. This is
	// Tessera's layout.
	Pack Order = iota
	// Spread lists each profile's placements across all GPUs before the next
	// placement: first-fit then scatters partitions over every GPU. It is what
	// a naive layout does, kept to measure Pack against.
	Spread
)

// Options shape the inventory.
type Options struct {
	// DynamicMIG publishes every MIG profile × placement as a partitionable
	// device of its GPU; without it, GPUs in MIG mode offer their existing
	// MIG devices and others are whole.
	DynamicMIG bool
	Order      Order
	// Sharing says, per GPU, how independent claims share it (see Share).
	// A shared GPU is offered whole only: MIG partitions cannot be time
	// sliced, and the scheduler cannot both share a device and split it.
	// GPUs in MIG mode are never shared.
	Sharing func(discovery.GPU) Share
}

// Inventory is the node's devices in publishing order.
type Inventory struct {
	Devices []Device
	byName  map[string]int
	// CounterSets lists the GPUs that have a counter set (dynamic MIG).
	CounterSets []discovery.GPU
}

// Build decides the node's devices.
func Build(gpus []discovery.GPU, opts Options) *Inventory {
	inv := &Inventory{byName: map[string]int{}}
	var perGPU [][]Device
	for _, g := range gpus {
		var devs []Device
		var share Share
		if opts.Sharing != nil && !g.MIGEnabled {
			share = opts.Sharing(g)
		}
		switch {
		case share.Shared():
			devs = []Device{{Name: g.Name(), Kind: Whole, GPU: g, Share: share}}
		case !g.MIGCapable || g.MIG == nil || len(g.MIG.Profiles) == 0:
			devs = []Device{{Name: g.Name(), Kind: Whole, GPU: g}}
		case opts.DynamicMIG && (g.MIGSwitchable || g.MIGEnabled):
			// Ampere GPUs switch MIG mode only with a reset: they offer
			// partitions only when an operator put them in MIG mode, and then
			// not as a whole GPU.
			devs = partitions(g, opts.Order)
			if g.MIGSwitchable {
				devs = append(devs, Device{Name: g.Name(), Kind: Whole, GPU: g, Counters: CounterSetName(g)})
			}
			inv.CounterSets = append(inv.CounterSets, g)
		case !opts.DynamicMIG && g.MIGEnabled:
			for _, in := range g.MIG.Existing {
				p, _ := g.MIG.ProfileByName(in.Profile)
				devs = append(devs, Device{Name: PartitionName(g, in.Profile, in.Placement.Start), Kind: StaticMIG, GPU: g, Profile: p, Placement: in.Placement, Instance: &in})
			}
		default:
			devs = []Device{{Name: g.Name(), Kind: Whole, GPU: g}}
		}
		perGPU = append(perGPU, devs)
	}
	if opts.Order == Spread {
		inv.Devices = spread(perGPU)
	} else {
		inv.Devices = byProfile(perGPU)
	}
	for i, d := range inv.Devices {
		inv.byName[d.Name] = i
	}
	return inv
}

// partitions lists a GPU's profile × placement devices, each profile's
// placements from the highest start down (see Pack).
func partitions(g discovery.GPU, order Order) []Device {
	var out []Device
	for _, p := range g.MIG.Profiles {
		pls := slices.Clone(p.Placements)
		slices.SortFunc(pls, func(a, b mig.Placement) int {
			if order == Spread {
				return a.Start - b.Start
			}
			return b.Start - a.Start
		})
		for _, pl := range pls {
			out = append(out, Device{Name: PartitionName(g, p.Name, pl.Start), Kind: Partition, GPU: g, Profile: p, Placement: pl, Counters: CounterSetName(g)})
		}
	}
	return out
}

// byProfile lists the whole GPUs, then the other devices grouped by profile
// (in the order profiles are first met), each group in GPU order (see Pack).
func byProfile(perGPU [][]Device) []Device {
	var order []string
	groups := map[string][]Device{}
	for _, devs := range perGPU {
		for _, d := range devs {
			key := "\x00whole" // before every profile name
			if d.Kind != Whole {
				key = d.Profile.Name
			}
			if _, seen := groups[key]; !seen {
				order = append(order, key)
			}
			groups[key] = append(groups[key], d)
		}
	}
	slices.SortStableFunc(order, func(a, b string) int {
		aw, bw := a == "\x00whole", b == "\x00whole"
		switch {
		case aw && !bw:
			return -1
		case bw && !aw:
			return 1
		}
		return 0
	})
	out := make([]Device, 0, len(groups))
	for _, key := range order {
		out = append(out, groups[key]...)
	}
	return out
}

// spread interleaves GPUs: the n-th device of every GPU before the n+1-th.
func spread(perGPU [][]Device) []Device {
	var out []Device
	for n := 0; ; n++ {
		added := false
		for _, devs := range perGPU {
			if n < len(devs) {
				out = append(out, devs[n])
				added = true
			}
		}
		if !added {
			return out
		}
	}
}

// Overlap says whether two different devices of the node use the same
// hardware: the whole GPU and any of its partitions, or partitions whose
// placements intersect. The scheduler's counters keep such pairs apart; the
// driver checks again, as the last line of defence.
func Overlap(a, b Device) bool {
	if a.Name == b.Name || a.GPU.UUID != b.GPU.UUID {
		return false
	}
	if a.Kind == Whole || b.Kind == Whole {
		return true
	}
	return a.Placement.Start < b.Placement.Start+b.Placement.Size && b.Placement.Start < a.Placement.Start+a.Placement.Size
}

// Lookup finds a device by name.
func (inv *Inventory) Lookup(name string) (Device, bool) {
	i, ok := inv.byName[name]
	if !ok {
		return Device{}, false
	}
	return inv.Devices[i], true
}

// Names lists every device name, sorted.
func (inv *Inventory) Names() []string {
	out := make([]string, 0, len(inv.Devices))
	for _, d := range inv.Devices {
		out = append(out, d.Name)
	}
	slices.Sort(out)
	return out
}

// CounterSetName names a GPU's counter set.
func CounterSetName(g discovery.GPU) string { return g.Name() }

var notLabel = regexp.MustCompile(`[^a-z0-9]+`)

// PartitionName names a MIG device: gpu-<index>-mig-<profile>-<start>, the
// profile folded by ProfileLabel.
func PartitionName(g discovery.GPU, profile string, start int) string {
	return fmt.Sprintf("%s-mig-%s-%d", g.Name(), ProfileLabel(profile), start)
}

// ProfileLabel folds a MIG profile name into what a DNS label may hold, for
// device and counter names, keeping every variant apart: 1g.10gb -> 1g10gb,
// 1g.10gb+me -> 1g10gbme, 1g.10gb-me -> 1g10gbnome, 1g.10gb+me.all ->
// 1g10gbmeall, 1g.10gb+gfx -> 1g10gbgfx. A name is "<n>g.<m>gb" and a
// variant suffix; "+" adds to the base and is dropped, "-" takes away and
// reads "no", so two different names never fold to one label.
func ProfileLabel(profile string) string {
	return notLabel.ReplaceAllString(strings.ReplaceAll(strings.ToLower(profile), "-", "no"), "")
}
