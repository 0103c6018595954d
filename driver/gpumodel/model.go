// Package gpumodel holds Tessera's own tables of the NVIDIA GPU models it
// simulates, as real NVML reports them: product, memory, power limits and the
// MIG profiles with their NVML index, unique ID, instance count, engines and
// placements on memory slices. Each table names its public source. Simulated
// nodes are built from these tables, never from a mock's defaults, and
// `tessera inspect --compare` checks a real GPU against them.
package gpumodel

import (
	"fmt"
	"slices"
	"sort"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// Model is one GPU board as NVML describes it.
type Model struct {
	// Key names the model in Tessera (h100-sxm5-80gb).
	Key string
	// Product is what nvmlDeviceGetName returns.
	Product      string
	Architecture nvml.DeviceArchitecture
	Brand        nvml.BrandType
	// MemoryMiB is the framebuffer total NVML reports (nvidia-smi's
	// "FB Memory Usage: Total"), not the marketing size.
	MemoryMiB            uint64
	CUDAMajor, CUDAMinor int
	// PCIDeviceID is NVML's combined device and vendor ID (0x233010DE).
	PCIDeviceID uint32
	// Power limits in watts: the board's constraints and its default.
	PowerMinW, PowerMaxW, PowerDefaultW uint32
	// LibDir is where a host's package manager installs the user-space
	// driver for this board's CPUs (GB200 trays are aarch64).
	LibDir string
	// MIG is nil for boards without MIG.
	MIG *MIG
	// Sources name the public documents the facts above come from.
	Sources []string
}

// MIG is a board's MIG table.
type MIG struct {
	// MemorySlices is how many memory slices placements are counted in.
	MemorySlices int
	// ResetToSwitch is true where a change of MIG mode needs a GPU reset
	// (Ampere); Hopper and newer switch without one.
	ResetToSwitch bool
	Profiles      []Profile
}

// Profile is one GPU-instance profile.
type Profile struct {
	// Name is nvidia-smi's name, e.g. 1g.10gb+me.
	Name string
	// Index is the GPU_INSTANCE_PROFILE_* value passed to
	// nvmlDeviceGetGpuInstanceProfileInfo: Tessera's identity of a profile.
	Index int
	// ID is the unique profile ID NVML reports in GpuInstanceProfileInfo.Id
	// and GpuInstanceInfo.ProfileId (nvidia-smi mig -lgip's "ID"): display
	// only.
	ID int
	// Instances is how many instances of the profile a GPU holds at most.
	Instances int
	// MemoryMiB is GpuInstanceProfileInfo.MemorySizeMB.
	MemoryMiB uint64
	// Compute slices and engines.
	Slices, SMs, CopyEngines, Decoders, Encoders, JPEGs, OFAs int
	// Placements are the valid starts, each Size memory slices long.
	Starts []int
	Size   int
}

// Placement is [Start, Start+Size) in memory slices.
type Placement struct{ Start, Size int }

// Placements lists the profile's valid placements.
func (p Profile) Placements() []Placement {
	out := make([]Placement, len(p.Starts))
	for i, s := range p.Starts {
		out[i] = Placement{Start: s, Size: p.Size}
	}
	return out
}

// ByIndex finds a profile by its NVML index.
func (m *MIG) ByIndex(index int) (Profile, bool) {
	for _, p := range m.Profiles {
		if p.Index == index {
			return p, true
		}
	}
	return Profile{}, false
}

// ByID finds a profile by NVML's unique profile ID.
func (m *MIG) ByID(id int) (Profile, bool) {
	for _, p := range m.Profiles {
		if p.ID == id {
			return p, true
		}
	}
	return Profile{}, false
}

// Lookup returns a copy of the model with the key, or an error listing the
// known ones.
func Lookup(key string) (Model, error) {
	m, ok := models[key]
	if !ok {
		return Model{}, fmt.Errorf("unknown GPU model %q: known models are %v", key, Keys())
	}
	return m.clone(), nil
}

// Keys lists the known models, sorted.
func Keys() []string {
	out := make([]string, 0, len(models))
	for k := range models {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// ByProduct finds the model whose product name NVML reports.
func ByProduct(product string) (Model, bool) {
	for _, k := range Keys() {
		if models[k].Product == product {
			return models[k].clone(), true
		}
	}
	return Model{}, false
}

func (m Model) clone() Model {
	m.Sources = slices.Clone(m.Sources)
	if m.MIG != nil {
		mg := *m.MIG
		mg.Profiles = slices.Clone(mg.Profiles)
		for i := range mg.Profiles {
			mg.Profiles[i].Starts = slices.Clone(mg.Profiles[i].Starts)
		}
		m.MIG = &mg
	}
	return m
}

var models = map[string]Model{}

func register(m Model) Model {
	if _, dup := models[m.Key]; dup {
		panic("gpumodel: model " + m.Key + " registered twice")
	}
	models[m.Key] = m
	return m
}
