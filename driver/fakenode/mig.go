package fakenode

import (
	"fmt"
	"slices"
	"sync"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
	"github.com/google/uuid"
)

// StaticInstance is a MIG instance an operator created before Tessera
// started: profile ID at a placement start.
type StaticInstance struct {
	ProfileID int
	Start     int
}

// callLog records the state-changing NVML calls a fake node receives, so
// tests can assert exactly what the driver asked the GPU to do.
type callLog struct {
	mu    sync.Mutex
	calls []string
}

func (l *callLog) add(format string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.calls = append(l.calls, fmt.Sprintf(format, args...))
}

// Calls returns the state-changing NVML calls so far, e.g.
// "gpu-0 SetMigMode(1)", "gpu-0 CreateGpuInstance(profile=0 start=6)".
func (n *Node) Calls() []string {
	n.log.mu.Lock()
	defer n.log.mu.Unlock()
	return slices.Clone(n.log.calls)
}

// ResetCalls forgets the calls recorded so far.
func (n *Node) ResetCalls() {
	n.log.mu.Lock()
	defer n.log.mu.Unlock()
	n.log.calls = nil
}

// GPUInstances counts the GPU instances that exist on a GPU now.
func (n *Node) GPUInstances(gpu int) int {
	d := n.Server.Devices[gpu].(*server.Device)
	d.RLock()
	defer d.RUnlock()
	return len(d.GpuInstances)
}

// completeMIG makes the mock's MIG behave like a real GPU's: creation only in
// MIG mode and never over an occupied or invalid placement, GPU instances not
// destroyable while compute instances live, MIG mode not switchable off while
// instances exist (and on Ampere not without a reset), and MIG device handles
// with UUIDs.
func completeMIG(d *server.Device, i int, p Profile, log *callLog, parentUUID func() string) {
	name := fmt.Sprintf("gpu-%d", i)
	if !p.MIGCapable {
		return
	}
	resetNeeded := p.GPU.Architecture < nvml.DEVICE_ARCH_HOPPER
	d.SetMigModeFunc = func(mode int) (nvml.Return, nvml.Return) {
		d.Lock()
		defer d.Unlock()
		log.add("%s SetMigMode(%d)", name, mode)
		if mode == nvml.DEVICE_MIG_DISABLE && len(d.GpuInstances) > 0 {
			return nvml.ERROR_IN_USE, nvml.ERROR_IN_USE
		}
		if resetNeeded && mode != d.MigMode {
			return nvml.SUCCESS, nvml.ERROR_RESET_REQUIRED
		}
		d.MigMode = mode
		return nvml.SUCCESS, nvml.SUCCESS
	}
	create := d.CreateGpuInstanceWithPlacementFunc
	d.CreateGpuInstanceWithPlacementFunc = func(info *nvml.GpuInstanceProfileInfo, pl *nvml.GpuInstancePlacement) (nvml.GpuInstance, nvml.Return) {
		log.add("%s CreateGpuInstance(profile=%d start=%d)", name, info.Id, pl.Start)
		d.RLock()
		mode := d.MigMode
		var taken []nvml.GpuInstancePlacement
		for gi := range d.GpuInstances {
			taken = append(taken, gi.Info.Placement)
		}
		d.RUnlock()
		if mode != nvml.DEVICE_MIG_ENABLE {
			return nil, nvml.ERROR_INVALID_STATE
		}
		if !slices.Contains(p.GPU.MIGProfiles.GpuInstancePlacements[int(info.Id)], *pl) {
			return nil, nvml.ERROR_INVALID_ARGUMENT
		}
		for _, t := range taken {
			if pl.Start < t.Start+t.Size && t.Start < pl.Start+pl.Size {
				return nil, nvml.ERROR_INSUFFICIENT_RESOURCES
			}
		}
		// Real NVML gives a new instance the lowest free ID; the mock counts
		// up forever, which would run past the 15 IDs a GPU has.
		d.Lock()
		d.GpuInstanceCounter = lowestFreeID(d)
		d.Unlock()
		gi, ret := create(info, pl)
		if ret == nvml.SUCCESS {
			completeGI(gi.(*server.GpuInstance), name, log)
		}
		return gi, ret
	}
	d.CreateGpuInstanceFunc = func(*nvml.GpuInstanceProfileInfo) (nvml.GpuInstance, nvml.Return) {
		// Tessera always places instances explicitly.
		return nil, nvml.ERROR_NOT_SUPPORTED
	}
	d.GetMaxMigDeviceCountFunc = func() (int, nvml.Return) { return 7, nvml.SUCCESS }
	d.GetMigDeviceHandleByIndexFunc = func(idx int) (nvml.Device, nvml.Return) {
		type pair struct{ gi, ci uint32 }
		var pairs []pair
		d.RLock()
		for gi := range d.GpuInstances {
			gi.RLock()
			for ci := range gi.ComputeInstances {
				pairs = append(pairs, pair{gi.Info.Id, ci.Info.Id})
			}
			gi.RUnlock()
		}
		d.RUnlock()
		slices.SortFunc(pairs, func(a, b pair) int {
			if a.gi != b.gi {
				return int(a.gi) - int(b.gi)
			}
			return int(a.ci) - int(b.ci)
		})
		if idx < 0 || idx >= len(pairs) {
			return nil, nvml.ERROR_NOT_FOUND
		}
		pr := pairs[idx]
		u := "MIG-" + uuid.NewSHA1(uuidSpace, fmt.Appendf(nil, "%s/%d/%d", parentUUID(), pr.gi, pr.ci)).String()
		return &mock.Device{
			GetUUIDFunc:                            func() (string, nvml.Return) { return u, nvml.SUCCESS },
			GetGpuInstanceIdFunc:                   func() (int, nvml.Return) { return int(pr.gi), nvml.SUCCESS },
			GetComputeInstanceIdFunc:               func() (int, nvml.Return) { return int(pr.ci), nvml.SUCCESS },
			IsMigDeviceHandleFunc:                  func() (bool, nvml.Return) { return true, nvml.SUCCESS },
			GetDeviceHandleFromMigDeviceHandleFunc: func() (nvml.Device, nvml.Return) { return d, nvml.SUCCESS },
		}, nvml.SUCCESS
	}
}

func lowestFreeID(d *server.Device) uint32 {
	used := map[uint32]bool{}
	for gi := range d.GpuInstances {
		used[gi.Info.Id] = true
	}
	id := uint32(0)
	for used[id] {
		id++
	}
	return id
}

func completeGI(gi *server.GpuInstance, name string, log *callLog) {
	destroy := gi.DestroyFunc
	gi.DestroyFunc = func() nvml.Return {
		gi.RLock()
		busy := len(gi.ComputeInstances) > 0
		gi.RUnlock()
		log.add("%s DestroyGpuInstance(profile=%d start=%d)", name, gi.Info.ProfileId, gi.Info.Placement.Start)
		if busy {
			return nvml.ERROR_IN_USE
		}
		return destroy()
	}
	createCI := gi.CreateComputeInstanceFunc
	gi.CreateComputeInstanceFunc = func(info *nvml.ComputeInstanceProfileInfo) (nvml.ComputeInstance, nvml.Return) {
		log.add("%s CreateComputeInstance(gi=%d profile=%d)", name, gi.Info.Id, info.Id)
		ci, ret := createCI(info)
		if ret == nvml.SUCCESS {
			c := ci.(*server.ComputeInstance)
			destroyCI := c.DestroyFunc
			c.DestroyFunc = func() nvml.Return {
				log.add("%s DestroyComputeInstance(gi=%d ci=%d)", name, gi.Info.Id, c.Info.Id)
				return destroyCI()
			}
		}
		return ci, ret
	}
}

// createStatic sets up an operator's MIG layout at construction.
func createStatic(d *server.Device, insts []StaticInstance) error {
	d.MigMode = nvml.DEVICE_MIG_ENABLE
	for _, s := range insts {
		info, ret := d.GetGpuInstanceProfileInfo(s.ProfileID)
		if ret != nvml.SUCCESS {
			return fmt.Errorf("static MIG profile %d: %v", s.ProfileID, ret)
		}
		var pl *nvml.GpuInstancePlacement
		for _, c := range d.Config.MIGProfiles.GpuInstancePlacements[s.ProfileID] {
			if int(c.Start) == s.Start {
				pl = &c
			}
		}
		if pl == nil {
			return fmt.Errorf("static MIG profile %d has no placement at %d", s.ProfileID, s.Start)
		}
		gi, ret := d.CreateGpuInstanceWithPlacement(&info, pl)
		if ret != nvml.SUCCESS {
			return fmt.Errorf("static MIG instance %d@%d: %v", s.ProfileID, s.Start, ret)
		}
		for id := 0; id < nvml.COMPUTE_INSTANCE_PROFILE_COUNT; id++ {
			cp, ret := gi.GetComputeInstanceProfileInfo(id, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
			if ret == nvml.SUCCESS && cp.SliceCount == info.SliceCount {
				if _, ret := gi.CreateComputeInstance(&cp); ret != nvml.SUCCESS {
					return fmt.Errorf("static MIG compute instance: %v", ret)
				}
				break
			}
		}
	}
	return nil
}
