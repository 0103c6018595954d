package mig

import (
	"errors"
	"fmt"
	"slices"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/tessera-dev/tessera/driver/gpulib"
)

// Instances lists the GPU's GPU instances (and their first compute
// instance), sorted by placement. A GPU not in MIG mode has none.
func Instances(d nvml.Device) ([]Instance, error) {
	info, err := readProfiles(d)
	if err != nil {
		return nil, err
	}
	return instances(d, info)
}

// instances lists the instances of the GPU's profiles, each named by its
// profile's index (NVML reports an instance's unique profile ID, which is
// matched back to the profile here and goes no further).
func instances(d nvml.Device, info *Info) ([]Instance, error) {
	var out []Instance
	for _, prof := range info.Profiles {
		p, ret := d.GetGpuInstanceProfileInfo(prof.Index)
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("read MIG profile %s: %w", prof.Name, gpulib.Error(ret))
		}
		gis, ret := d.GetGpuInstances(&p)
		if ret == nvml.ERROR_NOT_SUPPORTED || ret == nvml.ERROR_INVALID_STATE {
			continue
		}
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("list GPU instances of profile %s: %w", prof.Name, gpulib.Error(ret))
		}
		for _, gi := range gis {
			inst, err := describe(d, gi, prof)
			if err != nil {
				return nil, err
			}
			out = append(out, inst)
		}
	}
	slices.SortFunc(out, func(a, b Instance) int { return a.Placement.Start - b.Placement.Start })
	return out, nil
}

func describe(d nvml.Device, gi nvml.GpuInstance, p Profile) (Instance, error) {
	info, ret := gi.GetInfo()
	if ret != nvml.SUCCESS {
		return Instance{}, fmt.Errorf("read GPU instance: %w", gpulib.Error(ret))
	}
	if int(info.ProfileId) != p.NVMLID {
		return Instance{}, fmt.Errorf("GPU instance %d reports profile ID %d, listed under profile %s (ID %d)", info.Id, info.ProfileId, p.Name, p.NVMLID)
	}
	inst := Instance{
		ProfileIndex: p.Index, Profile: p.Name,
		Placement:     Placement{Start: int(info.Placement.Start), Size: int(info.Placement.Size)},
		GPUInstanceID: int(info.Id), ComputeInstanceID: -1,
	}
	ci, ok, err := firstComputeInstance(gi, p.Slices)
	if err != nil {
		return Instance{}, err
	}
	if ok {
		ciInfo, ret := ci.GetInfo()
		if ret != nvml.SUCCESS {
			return Instance{}, fmt.Errorf("read compute instance: %w", gpulib.Error(ret))
		}
		inst.ComputeInstanceID = int(ciInfo.Id)
		uuid, err := migUUID(d, inst.GPUInstanceID, inst.ComputeInstanceID)
		if err != nil {
			return Instance{}, err
		}
		inst.UUID = uuid
	}
	return inst, nil
}

// fullComputeProfile is the compute-instance profile spanning a whole GPU
// instance of the given slice count.
func fullComputeProfile(gi nvml.GpuInstance, slices int) (nvml.ComputeInstanceProfileInfo, error) {
	for id := 0; id < nvml.COMPUTE_INSTANCE_PROFILE_COUNT; id++ {
		p, ret := gi.GetComputeInstanceProfileInfo(id, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
		if ret == nvml.SUCCESS && int(p.SliceCount) == slices {
			return p, nil
		}
	}
	return nvml.ComputeInstanceProfileInfo{}, fmt.Errorf("no compute instance profile spans %d slices", slices)
}

func firstComputeInstance(gi nvml.GpuInstance, slices int) (nvml.ComputeInstance, bool, error) {
	p, err := fullComputeProfile(gi, slices)
	if err != nil {
		return nil, false, nil
	}
	cis, ret := gi.GetComputeInstances(&p)
	if ret != nvml.SUCCESS {
		return nil, false, fmt.Errorf("list compute instances: %w", gpulib.Error(ret))
	}
	if len(cis) == 0 {
		return nil, false, nil
	}
	return cis[0], true, nil
}

// migUUID finds the MIG device handle for a GI/CI pair and returns its UUID.
func migUUID(d nvml.Device, giID, ciID int) (string, error) {
	n, ret := d.GetMaxMigDeviceCount()
	if ret != nvml.SUCCESS {
		return "", fmt.Errorf("count MIG devices: %w", gpulib.Error(ret))
	}
	for i := 0; i < n; i++ {
		m, ret := d.GetMigDeviceHandleByIndex(i)
		if ret == nvml.ERROR_NOT_FOUND || ret == nvml.ERROR_INVALID_ARGUMENT {
			continue
		}
		if ret != nvml.SUCCESS {
			return "", fmt.Errorf("get MIG device %d: %w", i, gpulib.Error(ret))
		}
		g, ret1 := m.GetGpuInstanceId()
		c, ret2 := m.GetComputeInstanceId()
		if ret1 != nvml.SUCCESS || ret2 != nvml.SUCCESS || g != giID || c != ciID {
			continue
		}
		uuid, ret := m.GetUUID()
		if ret != nvml.SUCCESS {
			return "", fmt.Errorf("read MIG device UUID: %w", gpulib.Error(ret))
		}
		return uuid, nil
	}
	return "", fmt.Errorf("no MIG device for GPU instance %d compute instance %d", giID, ciID)
}

// ErrOccupied means the placement overlaps an existing GPU instance.
var ErrOccupied = errors.New("MIG placement is occupied")

// profile reads one profile of the GPU by index.
func profile(d nvml.Device, index int) (nvml.GpuInstanceProfileInfo, Profile, error) {
	info, err := readProfiles(d)
	if err != nil {
		return nvml.GpuInstanceProfileInfo{}, Profile{}, err
	}
	prof, ok := info.ProfileByIndex(index)
	if !ok {
		return nvml.GpuInstanceProfileInfo{}, Profile{}, fmt.Errorf("the GPU has no MIG profile of index %d", index)
	}
	p, ret := d.GetGpuInstanceProfileInfo(index)
	if ret != nvml.SUCCESS {
		return nvml.GpuInstanceProfileInfo{}, Profile{}, fmt.Errorf("read MIG profile %s: %w", prof.Name, gpulib.Error(ret))
	}
	return p, prof, nil
}

// Create makes a GPU instance of the profile (by index) at the placement,
// with one compute instance spanning it, and returns it. The GPU must be in
// MIG mode.
func Create(d nvml.Device, index int, pl Placement) (Instance, error) {
	p, prof, err := profile(d, index)
	if err != nil {
		return Instance{}, err
	}
	gi, ret := d.CreateGpuInstanceWithPlacement(&p, &nvml.GpuInstancePlacement{Start: uint32(pl.Start), Size: uint32(pl.Size)})
	if ret == nvml.ERROR_INSUFFICIENT_RESOURCES {
		return Instance{}, fmt.Errorf("create %s at %d: %w", prof.Name, pl.Start, ErrOccupied)
	}
	if ret != nvml.SUCCESS {
		return Instance{}, fmt.Errorf("create GPU instance %s at %d: %w", prof.Name, pl.Start, gpulib.Error(ret))
	}
	cp, err := fullComputeProfile(gi, int(p.SliceCount))
	if err == nil {
		_, ret = gi.CreateComputeInstance(&cp)
		if ret != nvml.SUCCESS {
			err = fmt.Errorf("create compute instance: %w", gpulib.Error(ret))
		}
	}
	if err != nil {
		if ret := gi.Destroy(); ret != nvml.SUCCESS {
			return Instance{}, fmt.Errorf("%w (and destroying the GPU instance failed: %v)", err, gpulib.Error(ret))
		}
		return Instance{}, err
	}
	return describe(d, gi, prof)
}

// Destroy removes the GPU instance of the profile at the placement (compute
// instances first), but only the one the caller made: the instance whose MIG
// device UUID is uuid, or, with uuid empty, an instance with no compute
// instance (nothing can run in it). Any other instance there is someone
// else's and is left alone (false, nil). A placement with no instance is not
// an error: destroy is idempotent.
func Destroy(d nvml.Device, index int, pl Placement, uuid string) (bool, error) {
	p, prof, err := profile(d, index)
	if err != nil {
		return false, err
	}
	gis, ret := d.GetGpuInstances(&p)
	if ret != nvml.SUCCESS {
		if ret == nvml.ERROR_NOT_SUPPORTED || ret == nvml.ERROR_INVALID_STATE {
			return false, nil
		}
		return false, fmt.Errorf("list GPU instances: %w", gpulib.Error(ret))
	}
	for _, gi := range gis {
		info, ret := gi.GetInfo()
		if ret != nvml.SUCCESS || int(info.Placement.Start) != pl.Start {
			continue
		}
		inst, err := describe(d, gi, prof)
		if err != nil {
			return false, err
		}
		if inst.UUID != uuid {
			return false, nil // not the instance the caller made
		}
		for id := 0; id < nvml.COMPUTE_INSTANCE_PROFILE_COUNT; id++ {
			cp, ret := gi.GetComputeInstanceProfileInfo(id, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
			if ret != nvml.SUCCESS {
				continue
			}
			cis, _ := gi.GetComputeInstances(&cp)
			for _, ci := range cis {
				if ret := ci.Destroy(); ret != nvml.SUCCESS {
					return false, fmt.Errorf("destroy compute instance of %s at %d: %w", prof.Name, pl.Start, gpulib.Error(ret))
				}
			}
		}
		if ret := gi.Destroy(); ret != nvml.SUCCESS {
			return false, fmt.Errorf("destroy GPU instance %s at %d: %w", prof.Name, pl.Start, gpulib.Error(ret))
		}
		return true, nil
	}
	return false, nil
}

// SetMode switches MIG mode; it fails on GPUs that need a reset to apply it.
func SetMode(d nvml.Device, enable bool) error {
	mode := nvml.DEVICE_MIG_DISABLE
	if enable {
		mode = nvml.DEVICE_MIG_ENABLE
	}
	ret, activation := d.SetMigMode(mode)
	if ret != nvml.SUCCESS {
		return fmt.Errorf("set MIG mode %d: %w", mode, gpulib.Error(ret))
	}
	if activation != nvml.SUCCESS {
		return fmt.Errorf("set MIG mode %d: not active without a GPU reset: %w", mode, gpulib.Error(activation))
	}
	return nil
}

// Enabled reports whether MIG mode is on now.
func Enabled(d nvml.Device) (bool, error) {
	cur, _, ret := d.GetMigMode()
	if ret != nvml.SUCCESS {
		return false, fmt.Errorf("read MIG mode: %w", gpulib.Error(ret))
	}
	return cur == nvml.DEVICE_MIG_ENABLE, nil
}
