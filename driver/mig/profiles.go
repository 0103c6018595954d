// Package mig knows NVIDIA Multi-Instance GPU: which partition profiles a GPU
// offers and where they may be placed, which instances exist, and how to
// create and destroy a GPU instance with its compute instance through NVML.
// It decides nothing about claims; driver/prepare calls it.
package mig

import (
	"fmt"
	"math"
	"slices"
	"strconv"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/tessera-dev/tessera/driver/gpulib"
)

// Profile is one GPU-instance profile a GPU supports, with its valid
// placements in memory-slice units.
type Profile struct {
	ID          int    // NVML GPU instance profile ID
	Name        string // e.g. 1g.10gb, 1g.10gb+me
	Slices      int    // compute slices
	MemoryBytes int64
	// Engines and multiprocessors the partition gets.
	Multiprocessors, CopyEngines, Decoders, Encoders, JPEGs, OFAs int
	// MaxInstances is how many instances of the profile a GPU can hold.
	MaxInstances int
	Placements   []Placement
}

// Placement is where a GPU instance sits: memory slices [Start, Start+Size).
type Placement struct{ Start, Size int }

// Info is a MIG-capable GPU's partitioning facts.
type Info struct {
	Profiles []Profile
	// MemorySlices is the number of placement units (memory slices).
	MemorySlices int
	// Existing lists the GPU's MIG devices at discovery time.
	Existing []Instance
}

// Instance is an existing GPU instance with its (first) compute instance.
type Instance struct {
	ProfileID         int
	Profile           string
	Placement         Placement
	GPUInstanceID     int
	ComputeInstanceID int
	UUID              string // the MIG device's UUID, MIG-...
}

// suffix names profile variants the way nvidia-smi does.
func suffix(id int) string {
	switch id {
	case nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1, nvml.GPU_INSTANCE_PROFILE_2_SLICE_REV1:
		return "+me"
	case nvml.GPU_INSTANCE_PROFILE_1_SLICE_GFX, nvml.GPU_INSTANCE_PROFILE_2_SLICE_GFX, nvml.GPU_INSTANCE_PROFILE_4_SLICE_GFX, nvml.GPU_INSTANCE_PROFILE_3_SLICE_GFX:
		return "+gfx"
	case nvml.GPU_INSTANCE_PROFILE_1_SLICE_NO_ME, nvml.GPU_INSTANCE_PROFILE_2_SLICE_NO_ME:
		return "-me"
	case nvml.GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME, nvml.GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME:
		return "+me.all"
	}
	return ""
}

// ProfileName is "<slices>g.<memory GB, rounded up>gb" plus a variant suffix.
func ProfileName(info nvml.GpuInstanceProfileInfo) string {
	gb := int(math.Ceil(float64(info.MemorySizeMB) / 1024))
	return strconv.Itoa(int(info.SliceCount)) + "g." + strconv.Itoa(gb) + "gb" + suffix(int(info.Id))
}

// Read returns the GPU's MIG profiles, placements and existing instances.
func Read(d nvml.Device) (*Info, error) {
	info := &Info{}
	for id := 0; id < nvml.GPU_INSTANCE_PROFILE_COUNT; id++ {
		p, ret := d.GetGpuInstanceProfileInfo(id)
		if ret == nvml.ERROR_NOT_SUPPORTED || ret == nvml.ERROR_INVALID_ARGUMENT {
			continue
		}
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("read MIG profile %d: %w", id, gpulib.Error(ret))
		}
		pls, ret := d.GetGpuInstancePossiblePlacements(&p)
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("read placements of MIG profile %s: %w", ProfileName(p), gpulib.Error(ret))
		}
		prof := Profile{
			ID: id, Name: ProfileName(p), Slices: int(p.SliceCount), MemoryBytes: int64(p.MemorySizeMB) << 20,
			Multiprocessors: int(p.MultiprocessorCount), CopyEngines: int(p.CopyEngineCount), Decoders: int(p.DecoderCount),
			Encoders: int(p.EncoderCount), JPEGs: int(p.JpegCount), OFAs: int(p.OfaCount),
			MaxInstances: int(p.InstanceCount),
		}
		for _, pl := range pls {
			prof.Placements = append(prof.Placements, Placement{Start: int(pl.Start), Size: int(pl.Size)})
			info.MemorySlices = max(info.MemorySlices, int(pl.Start+pl.Size))
		}
		if len(prof.Placements) > 0 {
			info.Profiles = append(info.Profiles, prof)
		}
	}
	slices.SortFunc(info.Profiles, func(a, b Profile) int { return a.ID - b.ID })
	existing, err := Instances(d)
	if err != nil {
		return nil, err
	}
	info.Existing = existing
	return info, nil
}

// ProfileByName finds a profile.
func (i *Info) ProfileByName(name string) (Profile, bool) {
	for _, p := range i.Profiles {
		if p.Name == name {
			return p, true
		}
	}
	return Profile{}, false
}
