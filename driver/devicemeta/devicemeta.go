// Package devicemeta says what each prepared device tells the workload that
// holds it, through the device metadata file the kubelet plugin helper
// writes for each request and mounts into the claim's containers
// (KEP-5304, kubeletplugin.EnableDeviceMetadata): a launcher reads the file
// instead of parsing environment variables.
//
// A GPU or MIG device's metadata is every attribute the node publishes for
// it, and what only the prepare knows: the partition's UUID once it exists,
// the memory a shared GPU's claim was granted, the power limit and compute
// mode the claim set. On a gang member's GPU claim it also holds the gang,
// its size and the member's rank and role; on a gang's domain claim, the
// domain, the channel and the domain's nodes. The names are in Attr*.
//
// It also removes the files of claims no longer prepared (Sweep, Forget):
// the helper removes them only when the kubelet unprepares a claim, and the
// plugin unprepares claims the kubelet forgot (driver/plugin, stale.go).
package devicemeta

import (
	"fmt"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/domain"
	"github.com/tessera-dev/tessera/driver/inventory"
	"github.com/tessera-dev/tessera/driver/slices"
)

// Attribute names the metadata adds to a device's published attributes,
// in the driver's domain (unqualified).
const (
	// AttrMemoryBytes is the memory the claim may use: the GPU's or
	// partition's, or on a memory-shared GPU what the claim was granted.
	AttrMemoryBytes = "memoryBytes"
	// AttrPowerLimitWatts is the board power limit the claim set.
	AttrPowerLimitWatts = "powerLimitWatts"
	// AttrComputeMode is the compute mode the claim set ("Default" for
	// time slicing, "ExclusiveProcess" under MPS).
	AttrComputeMode = "computeMode"
	// AttrGang is "<namespace>/<name>" of the claim's gang.
	AttrGang = "gang"
	// AttrGangSize is the gang's size (its most, in an elastic gang).
	AttrGangSize = "gangSize"
	// AttrGangRank is the member's rank, 0 to gangSize-1.
	AttrGangRank = "gangRank"
	// AttrRole, AttrRoleRank and AttrRoleSize are the member's role, its
	// rank within it and the role's size, in a gang with roles.
	AttrRole     = "role"
	AttrRoleRank = "roleRank"
	AttrRoleSize = "roleSize"
	// AttrDomain is the gang's domain (an NVLink domain or topology value).
	AttrDomain = "domain"
	// AttrDomainKind is "nvlink" or "topology".
	AttrDomainKind = "domainKind"
	// AttrChannel is the domain's IMEX channel.
	AttrChannel = "channel"
	// AttrDomainNodes is the domain's nodes, comma-separated, sorted.
	AttrDomainNodes = "domainNodes"
)

// Describe fills each device's Metadata from the inventory the node
// publishes and the devices as prepared (the claim's checkpoint record).
// A device the inventory no longer names (the node's GPUs changed under a
// prepared claim) keeps what the prepare recorded. An annotation of the
// gang controller's that does not parse fails it: the prepare then fails
// the same way on the environment it sets.
func Describe(inv *inventory.Inventory, claim *resourceapi.ResourceClaim, prepared []checkpoint.Device, devs []kubeletplugin.Device) ([]kubeletplugin.Device, error) {
	m, err := domain.ReadMember(claim)
	if err != nil {
		return nil, fmt.Errorf("claim %s/%s: %w", claim.Namespace, claim.Name, err)
	}
	byName := make(map[string]checkpoint.Device, len(prepared))
	for _, p := range prepared {
		byName[p.Pool+"/"+p.Device] = p
	}
	out := make([]kubeletplugin.Device, len(devs))
	for i, d := range devs {
		attrs := map[string]resourceapi.DeviceAttribute{}
		if dev, ok := inv.Lookup(d.DeviceName); ok {
			published := slices.Device(dev)
			for k, v := range published.Attributes {
				attrs[string(k)] = v
			}
			if c, ok := published.Capacity[slices.CapMemory]; ok {
				attrs[AttrMemoryBytes] = integer(c.Value.Value())
			}
		}
		if p, ok := byName[d.PoolName+"/"+d.DeviceName]; ok {
			recorded(attrs, p)
		}
		member(attrs, m)
		d.Metadata = &kubeletplugin.DeviceMetadata{Attributes: attrs}
		out[i] = d
	}
	return out, nil
}

// recorded adds what the prepare made of a device: the partition's UUID,
// the memory a share was granted, the settings the claim asked for.
func recorded(attrs map[string]resourceapi.DeviceAttribute, p checkpoint.Device) {
	if p.MIG != nil && p.MIG.UUID != "" {
		attrs[slices.AttrUUID] = str(p.MIG.UUID)
	}
	if p.MemoryBytes > 0 {
		attrs[AttrMemoryBytes] = integer(p.MemoryBytes)
	}
	if s := p.Settings; s != nil {
		if s.PowerLimitMW > 0 {
			attrs[AttrPowerLimitWatts] = integer(int64(s.PowerLimitMW) / 1000)
		}
		if s.ComputeMode != "" {
			attrs[AttrComputeMode] = str(s.ComputeMode)
		}
	}
}

// member adds the claim's gang, size, rank and role, where it has them.
func member(attrs map[string]resourceapi.DeviceAttribute, m domain.Member) {
	if m.Gang != "" {
		attrs[AttrGang] = str(m.Gang)
		attrs[AttrGangSize] = integer(int64(m.Size))
	}
	if m.Rank >= 0 {
		attrs[AttrGangRank] = integer(int64(m.Rank))
	}
	if m.Role != "" {
		attrs[AttrRole] = str(m.Role)
		attrs[AttrRoleRank] = integer(int64(m.RoleRank))
		attrs[AttrRoleSize] = integer(int64(m.RoleSize))
	}
}

// DescribeDomain fills the Metadata of a gang's domain claim's devices: the
// domain, its kind, the channel, the gang and its size, and the domain's
// nodes (the controller's nodes annotation).
func DescribeDomain(claim *resourceapi.ResourceClaim, devs []kubeletplugin.Device) ([]kubeletplugin.Device, error) {
	ref := claim.Namespace + "/" + claim.Name
	m, err := domain.ReadMember(claim)
	if err != nil {
		return nil, fmt.Errorf("claim %s: %w", ref, err)
	}
	var nodes []string
	if v, ok := claim.Annotations[gangv1.AnnotationNodes]; ok {
		ns, err := gangv1.ParseNodes(v)
		if err != nil {
			return nil, fmt.Errorf("claim %s: annotation %s: %w", ref, gangv1.AnnotationNodes, err)
		}
		for _, n := range ns {
			nodes = append(nodes, n.Name)
		}
	}
	out := make([]kubeletplugin.Device, len(devs))
	for i, d := range devs {
		attrs := map[string]resourceapi.DeviceAttribute{}
		if kind, value, ok := domain.ParsePool(d.PoolName); ok {
			attrs[AttrDomainKind] = str(kind)
			attrs[AttrDomain] = str(value)
		}
		if ch, err := domain.ParseDevice(d.DeviceName); err == nil {
			attrs[AttrChannel] = integer(int64(ch))
		}
		if len(nodes) > 0 {
			attrs[AttrDomainNodes] = str(strings.Join(nodes, ","))
		}
		member(attrs, m)
		d.Metadata = &kubeletplugin.DeviceMetadata{Attributes: attrs}
		out[i] = d
	}
	return out, nil
}

func str(s string) resourceapi.DeviceAttribute { return resourceapi.DeviceAttribute{StringValue: &s} }

func integer(i int64) resourceapi.DeviceAttribute { return resourceapi.DeviceAttribute{IntValue: &i} }
