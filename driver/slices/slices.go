// Package slices turns Tessera's device model into what a node publishes:
// ResourceSlice devices with typed attributes and capacities, laid out within
// the API's per-slice limits, in a deterministic order so that a restart
// publishes no diff.
package slices

import (
	"fmt"
	"maps"
	"slices"
	"sort"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/dynamic-resource-allocation/deviceattribute"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/utils/ptr"

	"github.com/tessera-dev/tessera/driver/discovery"
	"github.com/tessera-dev/tessera/driver/inventory"
	"github.com/tessera-dev/tessera/driver/lazymig"
)

// DriverName is the DRA driver name Tessera publishes under.
const DriverName = "gpu.tessera.dev"

// Attribute names in the driver's own domain (unqualified names belong to it).
const (
	AttrType                  = "type"
	AttrUUID                  = "uuid"
	AttrProductName           = "productName"
	AttrBrand                 = "brand"
	AttrArchitecture          = "architecture"
	AttrCUDAComputeCapability = "cudaComputeCapability"
	AttrDriverVersion         = "driverVersion"
	AttrCUDADriverVersion     = "cudaDriverVersion"
	AttrIndex                 = "index"
	AttrMIGCapable            = "migCapable"
	AttrNVLinkDomain          = "nvlinkDomain"
	AttrNVLinkClique          = "nvlinkClique"
	AttrPowerMinWatts         = "powerMinWatts"
	AttrPowerMaxWatts         = "powerMaxWatts"
	AttrPowerDefaultWatts     = "powerDefaultWatts"

	CapMemory     = "memory"
	CapTimeSlices = "timeSlices"

	TypeGPU = "gpu"
)

// API limits per ResourceSlice, as the API (resource.k8s.io/v1) defines
// them: a Kubernetes upgrade that changes one changes ours.
const (
	MaxDevicesPerSlice = resourceapi.ResourceSliceMaxDevices
	// MaxDevicesPerSliceWithCounters applies when any device has taints,
	// consumes counters or uses list attributes.
	MaxDevicesPerSliceWithCounters = resourceapi.ResourceSliceMaxDevicesWithAdvancedFeatures
	MaxAttributesAndCapacities     = resourceapi.ResourceSliceMaxAttributesAndCapacitiesPerDevice
	MaxCounterSetsPerSlice         = resourceapi.ResourceSliceMaxCounterSets
	MaxCountersPerSet              = resourceapi.ResourceSliceMaxCountersPerCounterSet
)

// GPUDevice is the published form of one whole GPU.
func GPUDevice(g discovery.GPU) resourceapi.Device {
	attrs := gpuAttributes(g)
	attrs[AttrType] = str(TypeGPU)
	attrs[AttrUUID] = str(g.UUID)
	attrs[AttrIndex] = integer(int64(g.Index))
	attrs[AttrMIGCapable] = resourceapi.DeviceAttribute{BoolValue: ptr.To(g.MIGCapable)}
	if g.PowerMaxWatts > 0 {
		attrs[AttrPowerMinWatts] = integer(g.PowerMinWatts)
		attrs[AttrPowerMaxWatts] = integer(g.PowerMaxWatts)
		attrs[AttrPowerDefaultWatts] = integer(g.PowerDefaultWatts)
	}
	return resourceapi.Device{
		Name:       g.Name(),
		Attributes: attrs,
		Capacity: map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{
			CapMemory: {Value: *resource.NewQuantity(g.MemoryBytes, resource.BinarySI)},
		},
	}
}

// Device is the published form of one of the inventory's devices, before
// Build adds what the node's state decides (counters, taints): a whole GPU,
// shared if the inventory says so, or a MIG device.
func Device(d inventory.Device) resourceapi.Device {
	if d.Kind != inventory.Whole {
		return MIGDevice(d)
	}
	dev := GPUDevice(d.GPU)
	dev.Name = d.Name
	share(&dev, d.GPU, d.Share)
	return dev
}

// gpuAttributes are what a GPU and each of its MIG devices share: the
// product, versions and topology a claim selects or aligns on.
func gpuAttributes(g discovery.GPU) map[resourceapi.QualifiedName]resourceapi.DeviceAttribute {
	attrs := map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
		AttrProductName:           str(g.ProductName),
		AttrBrand:                 str(g.Brand),
		AttrArchitecture:          str(g.Architecture),
		AttrCUDAComputeCapability: version(g.CUDAComputeCapability),
		AttrDriverVersion:         version(discovery.SemanticVersion(g.DriverVersion)),
		AttrCUDADriverVersion:     version(g.CUDADriverVersion),
		AttrNVLinkDomain:          str(g.NVLinkDomain),
		deviceattribute.StandardDeviceAttributePCIBusID: str(g.PCIBusID),
	}
	if g.PCIeRoot != "" {
		attrs[deviceattribute.StandardDeviceAttributePCIeRoot] = str(g.PCIeRoot)
	}
	if g.NUMANode != nil {
		attrs[deviceattribute.StandardDeviceAttributeNUMANode] = integer(int64(*g.NUMANode))
	}
	if g.NVLinkClique != "" {
		attrs[AttrNVLinkClique] = str(g.NVLinkClique)
	}
	return attrs
}

// Options adjust what Build publishes.
type Options struct {
	// Taints by GPU name (gpu-<index>); a GPU's MIG devices inherit them.
	Taints map[string][]resourceapi.DeviceTaint
	// Lazy, when set, publishes the partitions only of the GPUs it names
	// (driver/lazymig), those being withdrawn with its taint, each profile's
	// in its order; nil publishes every GPU's. A GPU without a whole device
	// (in MIG mode for good) offers nothing else and always publishes its
	// partitions, first.
	Lazy *lazymig.Decision
}

// Build lays out a node's devices as one pool named after the node: devices
// in the inventory's order, then the GPUs' counter sets in their own slices.
func Build(nodeName string, inv *inventory.Inventory, opts Options) (resourceslice.DriverResources, error) {
	if err := uniqueNames(inv); err != nil {
		return resourceslice.DriverResources{}, err
	}
	devices := make([]resourceapi.Device, 0, len(inv.Devices))
	limits := limitsByGPU{} // counterLimits, worked out once per GPU
	counted := countedGPUs(inv, opts.Lazy)
	for _, d := range inv.Devices {
		dev := Device(d)
		if d.Counters != "" && counted(d.GPU.Name()) {
			dev.ConsumesCounters = []resourceapi.DeviceCounterConsumption{{CounterSet: d.Counters, Counters: consumption(d, limits.of(d.GPU.MIG))}}
		}
		if t := opts.Taints[d.GPU.Name()]; len(t) > 0 {
			dev.Taints = t
		}
		if n := len(dev.Attributes) + len(dev.Capacity); n > MaxAttributesAndCapacities {
			return resourceslice.DriverResources{}, fmt.Errorf("device %s has %d attributes and capacities, the API allows %d", dev.Name, n, MaxAttributesAndCapacities)
		}
		devices = append(devices, dev)
	}
	var withdrawable map[string]bool
	if opts.Lazy != nil {
		withdrawable = map[string]bool{}
		for _, g := range LazyGPUs(inv) {
			withdrawable[g] = true
		}
		devices = lazily(inv, devices, *opts.Lazy)
	}
	out := chunk(devices)
	for sets := counterSets(inv, limits, withdrawable); len(sets) > 0; {
		n := min(MaxCounterSetsPerSlice, len(sets))
		out = append(out, resourceslice.Slice{SharedCounters: sets[:n]})
		sets = sets[n:]
	}
	return resourceslice.DriverResources{
		Pools: map[string]resourceslice.Pool{
			nodeName: {Slices: out},
		},
	}, nil
}

// LazyGPUs names the GPUs lazy publishing applies to, in the inventory's
// GPU order: those that offer their whole device beside their partitions
// (dynamic MIG on a GPU that switches MIG mode without a reset). A GPU in
// MIG mode for good offers nothing but its partitions, always published.
func LazyGPUs(inv *inventory.Inventory) []string {
	var out []string
	for _, d := range inv.Devices {
		if d.Kind == inventory.Whole && d.Counters != "" {
			out = append(out, d.GPU.Name())
		}
	}
	return out
}

// Unheld is what lazy publishing decides for a node that holds nothing and
// has published nothing: the spares' partitions alone. It is what a fresh
// node publishes, what `tessera inspect` shows and what the benchmarks'
// nodes publish.
func Unheld(inv *inventory.Inventory, p lazymig.Policy) lazymig.Decision {
	var gpus []lazymig.GPU
	for _, g := range LazyGPUs(inv) {
		gpus = append(gpus, lazymig.GPU{Name: g})
	}
	return lazymig.Decide(gpus, p, time.Time{})
}

// countedGPUs says which GPUs' devices draw on their counter set. Published
// lazily, a GPU whose partitions are not published offers its whole device
// alone, drawing on nothing: the scheduler then validates one counter
// reference per open GPU instead of one per GPU. Its counter set stays
// published (the counter slice never changes), so that opening or closing
// a GPU changes the device slice alone: one write, which the scheduler sees
// at once, whole device and partitions together. The scheduler works out
// what allocated devices consume from the devices as published now, so a
// whole GPU allocated while it drew on nothing blocks its partitions the
// moment they appear; the reverse, a partition allocated and then
// withdrawn, is what driver/lazymig guards. Every other GPU's devices draw
// on their counter set.
func countedGPUs(inv *inventory.Inventory, d *lazymig.Decision) func(gpu string) bool {
	if d == nil {
		return func(string) bool { return true }
	}
	lazy := map[string]bool{}
	for _, g := range LazyGPUs(inv) {
		lazy[g] = true
	}
	return func(gpu string) bool {
		_, published := d.States[gpu]
		return published || !lazy[gpu]
	}
}

// lazily keeps the partitions of the GPUs d publishes, tainted while they
// are withdrawn, and orders each profile's by d.Order; devices are in the
// inventory's order (whole GPUs first, then each profile's partitions).
func lazily(inv *inventory.Inventory, devices []resourceapi.Device, d lazymig.Decision) []resourceapi.Device {
	whole := map[string]bool{}
	for _, g := range LazyGPUs(inv) {
		whole[g] = true
	}
	rank := map[string]int{}
	for i, name := range d.Order {
		rank[name] = i + 1 // 0: GPUs without a whole device
	}
	type kept struct {
		dev         resourceapi.Device
		group, rank int
	}
	var out []kept
	groups := map[string]int{}
	for i, dev := range devices {
		src := inv.Devices[i]
		if src.Kind != inventory.Partition {
			out = append(out, kept{dev: dev, group: -1})
			continue
		}
		gpu := src.GPU.Name()
		if whole[gpu] {
			s, ok := d.States[gpu]
			if !ok {
				continue
			}
			if s.IsClosing() {
				dev.Taints = append(slices.Clone(dev.Taints), resourceapi.DeviceTaint{Key: lazymig.TaintKey, Effect: resourceapi.DeviceTaintEffectNoSchedule, TimeAdded: &metav1.Time{Time: s.Closing}})
				withdrawing(&dev)
			}
		}
		g, seen := groups[src.Profile.Name]
		if !seen {
			g = len(groups)
			groups[src.Profile.Name] = g
		}
		out = append(out, kept{dev: dev, group: g, rank: rank[gpu]})
	}
	sort.SliceStable(out, func(a, b int) bool {
		if out[a].group != out[b].group {
			return out[a].group < out[b].group
		}
		return out[a].rank < out[b].rank
	})
	res := make([]resourceapi.Device, len(out))
	for i, k := range out {
		res[i] = k.dev
	}
	return res
}

// withdrawing makes a partition being withdrawn unallocatable: it consumes
// counterWithdrawing, of which its GPU's counter set holds none. The taint
// alone says so only to claims that do not tolerate it, and a claim that
// tolerates every taint (as docs/gang.md recommends for health taints)
// could be allocated one at the grace's last moment and written after the
// withdrawal, its pod held in the scheduler's PreBind on a volume: a
// partition the scheduler no longer counts against its GPU. A partition
// allocated before this was published keeps drawing on its GPU's counters
// (it stays published) until the grace, which outlasts such a wait, ends.
func withdrawing(dev *resourceapi.Device) {
	one := resourceapi.Counter{Value: *resource.NewQuantity(1, resource.DecimalSI)}
	cc := slices.Clone(dev.ConsumesCounters)
	for i := range cc {
		counters := maps.Clone(cc[i].Counters)
		counters[counterWithdrawing] = one
		cc[i].Counters = counters
	}
	dev.ConsumesCounters = cc
}

// uniqueNames refuses an inventory in which two devices, two counter sets,
// or two MIG profiles of one GPU (whose labels name its instance counters)
// would share a name: the API server would reject the slice, or worse, the
// scheduler would count two things as one.
func uniqueNames(inv *inventory.Inventory) error {
	sets := map[string]bool{}
	for _, g := range inv.CounterSets {
		name := inventory.CounterSetName(g)
		if sets[name] {
			return fmt.Errorf("two counter sets are both named %s", name)
		}
		sets[name] = true
		labels := map[string]string{}
		for _, p := range g.MIG.Profiles {
			l := inventory.ProfileLabel(p.Name)
			if other, dup := labels[l]; dup {
				return fmt.Errorf("GPU %s: MIG profiles %s and %s both fold to %q, so their devices and counters would share names; this is a bug, please report it with the output of nvidia-smi mig -lgip", g.Name(), other, p.Name, l)
			}
			labels[l] = p.Name
		}
	}
	devices := map[string]bool{}
	for _, d := range inv.Devices {
		if devices[d.Name] {
			return fmt.Errorf("two devices of GPU %s are both named %s: a MIG profile name folds onto another's; this is a bug, please report it with the output of nvidia-smi mig -lgip", d.GPU.Name(), d.Name)
		}
		devices[d.Name] = true
	}
	return nil
}

// chunk splits devices into slices within the per-slice device limit.
func chunk(devices []resourceapi.Device) []resourceslice.Slice {
	limit := MaxDevicesPerSlice
	for _, d := range devices {
		if len(d.Taints) > 0 || len(d.ConsumesCounters) > 0 {
			limit = MaxDevicesPerSliceWithCounters
			break
		}
	}
	var out []resourceslice.Slice
	for len(devices) > 0 {
		n := min(limit, len(devices))
		out = append(out, resourceslice.Slice{Devices: devices[:n]})
		devices = devices[n:]
	}
	if len(out) == 0 {
		// A node without GPUs still publishes its (empty) pool so that the
		// scheduler knows the driver runs there.
		out = append(out, resourceslice.Slice{})
	}
	return out
}

// Objects renders DriverResources as the ResourceSlice objects the
// resourceslice controller would create for a node, for display. Names follow
// the controller's "<index>-<driver>-<node>" prefix, without its random suffix.
func Objects(nodeName string, res resourceslice.DriverResources) []resourceapi.ResourceSlice {
	pools := make([]string, 0, len(res.Pools))
	for name := range res.Pools {
		pools = append(pools, name)
	}
	sort.Strings(pools)
	var out []resourceapi.ResourceSlice
	for _, name := range pools {
		pool := res.Pools[name]
		for i, s := range pool.Slices {
			out = append(out, resourceapi.ResourceSlice{
				TypeMeta:   metav1.TypeMeta{APIVersion: resourceapi.SchemeGroupVersion.String(), Kind: "ResourceSlice"},
				ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("%x-%s-%s", i, DriverName, nodeName)},
				Spec: resourceapi.ResourceSliceSpec{
					Driver:   DriverName,
					NodeName: ptr.To(nodeName),
					Pool: resourceapi.ResourcePool{
						Name:               name,
						Generation:         pool.Generation,
						ResourceSliceCount: int64(len(pool.Slices)),
					},
					Devices:        s.Devices,
					SharedCounters: s.SharedCounters,
				},
			})
		}
	}
	return out
}

func str(s string) resourceapi.DeviceAttribute { return resourceapi.DeviceAttribute{StringValue: &s} }
func version(s string) resourceapi.DeviceAttribute {
	return resourceapi.DeviceAttribute{VersionValue: &s}
}
func integer(i int64) resourceapi.DeviceAttribute { return resourceapi.DeviceAttribute{IntValue: &i} }
