package fakenode

import (
	"fmt"
	"slices"
	"sort"
	"strings"

	"github.com/tessera-dev/tessera/driver/gpumodel"
)

// Profile describes a simulated GPU node: which GPU model it carries
// (Tessera's own table, driver/gpumodel) and the node's topology. Tests may
// copy a profile and change its topology (for example split its NVLink
// islands).
type Profile struct {
	Name string
	// GPU is the board every GPU of the node is; whether it has MIG, and
	// its MIG table, come from it.
	GPU gpumodel.Model
	// DriverVersion is what NVML reports (zero-padded parts as NVIDIA
	// numbers its releases: 570.124.06) and what the driver's files are
	// named by; CUDADriverVersion is that driver's CUDA version as NVML
	// encodes it (12080 for 12.8), from NVIDIA's release notes of the driver.
	DriverVersion     string
	CUDADriverVersion int
	// GPUs lists each GPU's PCI placement, in NVML index order.
	GPUs []Placement
	// NVLinkIslands lists groups of GPU indexes joined by NVLink (through
	// NVSwitch on DGX systems). A GPU in no island has no NVLink peers.
	NVLinkIslands [][]int
	// NVLinks is how many NVLinks each GPU of an island has up.
	NVLinks int
	// Fabric, when set, is what GetGpuFabricInfo reports (multi-node NVLink).
	Fabric *Fabric
	// MIGEnabled lists GPUs an operator put in MIG mode before start.
	MIGEnabled []int
	// MIGInstances are MIG instances an operator created before start, by
	// GPU index (their GPUs are in MIG mode).
	MIGInstances map[int][]StaticInstance
}

// Placement is where one GPU sits on the PCI tree.
type Placement struct {
	BusID    string // extended BDF, e.g. 0000:18:00.0
	PCIeRoot string // root complex, e.g. pci0000:15
	Switch   string // bridge the GPU hangs off; GPUs sharing it are one PCIe switch apart
	NUMANode int
}

// Fabric is a GPU's multi-node NVLink fabric membership.
type Fabric struct {
	ClusterUUID string // 36-character UUID
	CliqueID    uint32
}

// dgxPlacement lays eight GPUs out as DGX systems do: two per PCIe switch,
// one switch per root complex, four GPUs per CPU socket.
func dgxPlacement(buses [8]string, roots [4]string) []Placement {
	out := make([]Placement, 8)
	for i, bus := range buses {
		out[i] = Placement{
			BusID:    fmt.Sprintf("0000:%s:00.0", bus),
			PCIeRoot: roots[i/2],
			Switch:   fmt.Sprintf("%s-sw%d", roots[i/2], i/2),
			NUMANode: i / 4,
		}
	}
	return out
}

func all(n int) [][]int {
	island := make([]int, n)
	for i := range island {
		island[i] = i
	}
	return [][]int{island}
}

var profiles = map[string]Profile{
	"dgx-a100": {
		Name: "dgx-a100", GPU: gpumodel.A100SXM40GB, DriverVersion: "550.54.15", CUDADriverVersion: 12040,
		GPUs:          dgxPlacement([8]string{"07", "0f", "47", "4e", "87", "90", "b7", "bd"}, [4]string{"pci0000:00", "pci0000:40", "pci0000:80", "pci0000:c0"}),
		NVLinkIslands: all(8), NVLinks: 12,
	},
	"dgx-a100-80gb": {
		Name: "dgx-a100-80gb", GPU: gpumodel.A100SXM80GB, DriverVersion: "550.54.15", CUDADriverVersion: 12040,
		GPUs:          dgxPlacement([8]string{"07", "0f", "47", "4e", "87", "90", "b7", "bd"}, [4]string{"pci0000:00", "pci0000:40", "pci0000:80", "pci0000:c0"}),
		NVLinkIslands: all(8), NVLinks: 12,
	},
	"dgx-h100": {
		Name: "dgx-h100", GPU: gpumodel.H100SXM80GB, DriverVersion: "550.54.15", CUDADriverVersion: 12040,
		GPUs:          dgxPlacement([8]string{"18", "2a", "3a", "5d", "9a", "ab", "ba", "db"}, [4]string{"pci0000:15", "pci0000:37", "pci0000:97", "pci0000:b7"}),
		NVLinkIslands: all(8), NVLinks: 18,
	},
	"dgx-h200": {
		Name: "dgx-h200", GPU: gpumodel.H200SXM141GB, DriverVersion: "550.90.07", CUDADriverVersion: 12040,
		GPUs:          dgxPlacement([8]string{"18", "2a", "3a", "5d", "9a", "ab", "ba", "db"}, [4]string{"pci0000:15", "pci0000:37", "pci0000:97", "pci0000:b7"}),
		NVLinkIslands: all(8), NVLinks: 18,
	},
	"dgx-b200": {
		Name: "dgx-b200", GPU: gpumodel.B200, DriverVersion: "570.124.06", CUDADriverVersion: 12080,
		GPUs:          dgxPlacement([8]string{"1b", "43", "52", "61", "9d", "c3", "d1", "df"}, [4]string{"pci0000:15", "pci0000:37", "pci0000:97", "pci0000:b7"}),
		NVLinkIslands: all(8), NVLinks: 18,
	},
	"gb200-nvl72-tray": {
		Name: "gb200-nvl72-tray", GPU: gpumodel.GB200, DriverVersion: "570.124.06", CUDADriverVersion: 12080,
		GPUs: []Placement{
			{BusID: "0008:01:00.0", PCIeRoot: "pci0008:00", Switch: "pci0008:00-rp", NUMANode: 0},
			{BusID: "0009:01:00.0", PCIeRoot: "pci0009:00", Switch: "pci0009:00-rp", NUMANode: 0},
			{BusID: "0018:01:00.0", PCIeRoot: "pci0018:00", Switch: "pci0018:00-rp", NUMANode: 1},
			{BusID: "0019:01:00.0", PCIeRoot: "pci0019:00", Switch: "pci0019:00-rp", NUMANode: 1},
		},
		NVLinkIslands: all(4), NVLinks: 18,
		Fabric: &Fabric{ClusterUUID: "7b2f0c5e-1d4a-4e8b-9c3f-0a6d5e4b3c21", CliqueID: 1},
	},
	"pcie-l4x4": {
		Name: "pcie-l4x4", GPU: gpumodel.L4, DriverVersion: "535.183.01", CUDADriverVersion: 12020,
		GPUs: []Placement{
			{BusID: "0000:01:00.0", PCIeRoot: "pci0000:00", Switch: "pci0000:00-sw0", NUMANode: 0},
			{BusID: "0000:02:00.0", PCIeRoot: "pci0000:00", Switch: "pci0000:00-sw0", NUMANode: 0},
			{BusID: "0000:81:00.0", PCIeRoot: "pci0000:80", Switch: "pci0000:80-sw0", NUMANode: 1},
			{BusID: "0000:82:00.0", PCIeRoot: "pci0000:80", Switch: "pci0000:80-sw0", NUMANode: 1},
		},
	},
}

// Profiles returns the names of the known profiles, sorted.
func Profiles() []string {
	names := make([]string, 0, len(profiles))
	for n := range profiles {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// Lookup returns a copy of the named profile, or an error listing the known ones.
func Lookup(name string) (Profile, error) {
	p, ok := profiles[name]
	if !ok {
		return Profile{}, fmt.Errorf("unknown fake node profile %q: known profiles are %s", name, strings.Join(Profiles(), ", "))
	}
	p.GPUs = append([]Placement(nil), p.GPUs...)
	islands := make([][]int, len(p.NVLinkIslands))
	for i, is := range p.NVLinkIslands {
		islands[i] = append([]int(nil), is...)
	}
	p.NVLinkIslands = islands
	if p.Fabric != nil {
		f := *p.Fabric
		p.Fabric = &f
	}
	p.MIGEnabled = slices.Clone(p.MIGEnabled)
	p.GPU, _ = gpumodel.Lookup(p.GPU.Key)
	return p, nil
}
