// Package mig knows NVIDIA Multi-Instance GPU: which partition profiles a GPU
// offers and where they may be placed, which instances exist, and how to
// create and destroy a GPU instance with its compute instance through NVML.
// It decides nothing about claims; driver/prepare calls it.
package mig

import (
	"fmt"
	"slices"
	"strconv"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/tessera-dev/tessera/driver/gpulib"
)

// Profile is one GPU-instance profile a GPU supports, with its valid
// placements in memory-slice units.
//
// A profile's identity is its Index, the GPU_INSTANCE_PROFILE_* value passed
// to nvmlDeviceGetGpuInstanceProfileInfo: names, device names, counters, the
// checkpoint and the orphan sweep all use it. NVMLID is the unique profile ID
// NVML reports back (GpuInstanceProfileInfo.Id, GpuInstanceInfo.ProfileId;
// H100: 19 for 1g.10gb, 0 for 7g.80gb), kept for display and for matching
// existing instances to their profile, never as an identity of its own.
type Profile struct {
	Index       int
	NVMLID      int
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
	// ProfileIndex is the instance's profile (Profile.Index).
	ProfileIndex      int
	Profile           string
	Placement         Placement
	GPUInstanceID     int
	ComputeInstanceID int
	UUID              string // the MIG device's UUID, MIG-...
}

// suffix names profile variants the way nvidia-smi does, by profile index.
func suffix(index int) string {
	switch index {
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

// profileName is "<slices>g.<GB>gb" plus the variant suffix of the profile's
// index. NVIDIA names a profile by its share of the board's nominal memory,
// not by the memory NVML reports for it (an H200's 1g.18gb reports 16 GiB):
// GB is the board's nominal size (its total memory in GiB, rounded up)
// times the profile's share of the memory slices, rounded half up.
func profileName(index, computeSlices, size, memorySlices int, totalMiB uint64) string {
	nominal := int((totalMiB + 1023) / 1024)
	gb := (2*nominal*size + memorySlices) / (2 * memorySlices)
	return strconv.Itoa(computeSlices) + "g." + strconv.Itoa(gb) + "gb" + suffix(index)
}

// Read returns the GPU's MIG profiles, placements and existing instances.
func Read(d nvml.Device) (*Info, error) {
	info, err := readProfiles(d)
	if err != nil {
		return nil, err
	}
	existing, err := instances(d, info)
	if err != nil {
		return nil, err
	}
	info.Existing = existing
	return info, nil
}

// readProfiles reads every profile index NVML answers for, with its
// placements, and names them.
func readProfiles(d nvml.Device) (*Info, error) {
	info := &Info{}
	for index := 0; index < nvml.GPU_INSTANCE_PROFILE_COUNT; index++ {
		p, ret := d.GetGpuInstanceProfileInfo(index)
		if ret == nvml.ERROR_NOT_SUPPORTED || ret == nvml.ERROR_INVALID_ARGUMENT {
			continue
		}
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("read MIG profile index %d: %w", index, gpulib.Error(ret))
		}
		pls, ret := d.GetGpuInstancePossiblePlacements(&p)
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("read placements of MIG profile index %d (ID %d): %w", index, p.Id, gpulib.Error(ret))
		}
		prof := Profile{
			Index: index, NVMLID: int(p.Id), Slices: int(p.SliceCount), MemoryBytes: int64(p.MemorySizeMB) << 20,
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
	if len(info.Profiles) == 0 {
		return info, nil
	}
	mem, ret := d.GetMemoryInfo()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("read GPU memory: %w", gpulib.Error(ret))
	}
	for i := range info.Profiles {
		p := &info.Profiles[i]
		p.Name = profileName(p.Index, p.Slices, p.Placements[0].Size, info.MemorySlices, mem.Total>>20)
	}
	slices.SortFunc(info.Profiles, func(a, b Profile) int { return a.Index - b.Index })
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

// ProfileByIndex finds a profile by its index.
func (i *Info) ProfileByIndex(index int) (Profile, bool) {
	for _, p := range i.Profiles {
		if p.Index == index {
			return p, true
		}
	}
	return Profile{}, false
}
