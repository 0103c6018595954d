package fakenode

import (
	"fmt"
	"slices"
	"sync"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/gpus"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
	"github.com/google/uuid"

	"github.com/tessera-dev/tessera/driver/gpumodel"
)

// StaticInstance is a MIG instance an operator created before Tessera
// started: profile index (GPU_INSTANCE_PROFILE_*) at a placement start.
type StaticInstance struct {
	Index int
	Start int
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
// "gpu-0 SetMigMode(1)", "gpu-0 CreateGpuInstance(profile=19 start=6)"
// (profile: NVML's unique profile ID, as real NVML reports it).
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

// CreateInstance makes a MIG instance on a GPU behind the driver's back, as
// an operator or mig-manager would: a GPU instance of the profile (by index)
// at start with one compute instance spanning it. The GPU enters MIG mode
// first where that needs no reset.
func (n *Node) CreateInstance(gpu int, index, start int) error {
	d := n.Server.Devices[gpu].(*server.Device)
	return createStatic(d, n.Profile.GPU.MIG, []StaticInstance{{Index: index, Start: start}})
}

// mockConfig is the go-nvml mock's configuration built from Tessera's table:
// the mock serves the calls, the table supplies every fact. Profile infos
// are keyed by NVML index and carry NVML's unique ID, as real NVML's do;
// placements and compute-instance profiles are keyed by the unique ID, which
// is what the mock looks them up by (GpuInstanceProfileInfo.Id and
// GpuInstanceInfo.ProfileId).
func mockConfig(m gpumodel.Model) gpus.Config {
	c := gpus.Config{
		Name: m.Product, Architecture: m.Architecture, Brand: m.Brand, MemoryMB: m.MemoryMiB,
		CudaMajor: m.CUDAMajor, CudaMinor: m.CUDAMinor, PciDeviceId: m.PCIDeviceID,
	}
	if m.MIG == nil {
		return c
	}
	c.MIGProfiles = gpus.MIGProfileConfig{
		GpuInstanceProfiles:     map[int]nvml.GpuInstanceProfileInfo{},
		ComputeInstanceProfiles: map[int]map[int]nvml.ComputeInstanceProfileInfo{},
		GpuInstancePlacements:   map[int][]nvml.GpuInstancePlacement{},
	}
	for _, p := range m.MIG.Profiles {
		c.MIGProfiles.GpuInstanceProfiles[p.Index] = nvml.GpuInstanceProfileInfo{
			Id: uint32(p.ID), SliceCount: uint32(p.Slices), InstanceCount: uint32(p.Instances),
			MultiprocessorCount: uint32(p.SMs), CopyEngineCount: uint32(p.CopyEngines), DecoderCount: uint32(p.Decoders),
			EncoderCount: uint32(p.Encoders), JpegCount: uint32(p.JPEGs), OfaCount: uint32(p.OFAs), MemorySizeMB: p.MemoryMiB,
		}
		var pls []nvml.GpuInstancePlacement
		for _, pl := range p.Placements() {
			pls = append(pls, nvml.GpuInstancePlacement{Start: uint32(pl.Start), Size: uint32(pl.Size)})
		}
		c.MIGProfiles.GpuInstancePlacements[p.ID] = pls
		c.MIGProfiles.ComputeInstanceProfiles[p.ID] = computeProfiles(p)
	}
	return c
}

// computeProfiles are the compute-instance profiles of a GPU instance: one
// for each compute-slice count up to the instance's, indexed by
// COMPUTE_INSTANCE_PROFILE_* (1, 2, 3, 4 and 7 slices).
func computeProfiles(p gpumodel.Profile) map[int]nvml.ComputeInstanceProfileInfo {
	out := map[int]nvml.ComputeInstanceProfileInfo{}
	for _, c := range []struct{ index, slices int }{
		{nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, 1}, {nvml.COMPUTE_INSTANCE_PROFILE_2_SLICE, 2},
		{nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE, 3}, {nvml.COMPUTE_INSTANCE_PROFILE_4_SLICE, 4},
		{nvml.COMPUTE_INSTANCE_PROFILE_7_SLICE, 7},
	} {
		if c.slices > p.Slices || c.slices == 7 && p.Slices != 7 {
			continue
		}
		out[c.index] = nvml.ComputeInstanceProfileInfo{
			Id: uint32(c.index), SliceCount: uint32(c.slices), InstanceCount: uint32(p.Slices / c.slices),
			MultiprocessorCount: uint32(p.SMs * c.slices / p.Slices),
		}
	}
	return out
}

// completeMIG makes the mock's MIG behave like a real GPU's, from the
// model's table: profiles only where the board has MIG; creation only in MIG
// mode, on a documented placement, never over an occupied one and never past
// the profile's instance count; GPU instances not destroyable while compute
// instances live; compute instances never beyond their GPU instance's
// slices; MIG mode not switchable off while instances exist, and on Ampere
// not without a reset; MIG device handles with UUIDs.
// completeMIG fills in MIG for device d, GPU i of profile p. changed is
// called after every change of MIG state that succeeded (mode, instances);
// the function returned restores a saved state into the fresh device.
func completeMIG(d *server.Device, i int, p Profile, log *callLog, parentUUID func() string, changed func()) func(savedGPU) error {
	name := fmt.Sprintf("gpu-%d", i)
	table := p.GPU.MIG
	if table == nil {
		d.GetMigModeFunc = func() (int, int, nvml.Return) { return 0, 0, nvml.ERROR_NOT_SUPPORTED }
		d.SetMigModeFunc = func(int) (nvml.Return, nvml.Return) { return nvml.ERROR_NOT_SUPPORTED, nvml.ERROR_NOT_SUPPORTED }
		d.GetGpuInstanceProfileInfoFunc = func(int) (nvml.GpuInstanceProfileInfo, nvml.Return) {
			return nvml.GpuInstanceProfileInfo{}, nvml.ERROR_NOT_SUPPORTED
		}
		return func(savedGPU) error { return nil }
	}
	setMode := func(mode int) (nvml.Return, nvml.Return) {
		d.Lock()
		defer d.Unlock()
		log.add("%s SetMigMode(%d)", name, mode)
		if mode != nvml.DEVICE_MIG_DISABLE && mode != nvml.DEVICE_MIG_ENABLE {
			return nvml.ERROR_INVALID_ARGUMENT, nvml.ERROR_INVALID_ARGUMENT
		}
		if mode == nvml.DEVICE_MIG_DISABLE && len(d.GpuInstances) > 0 {
			return nvml.ERROR_IN_USE, nvml.ERROR_IN_USE
		}
		if table.ResetToSwitch && mode != d.MigMode {
			return nvml.SUCCESS, nvml.ERROR_RESET_REQUIRED
		}
		d.MigMode = mode
		return nvml.SUCCESS, nvml.SUCCESS
	}
	d.SetMigModeFunc = func(mode int) (nvml.Return, nvml.Return) {
		ret, activation := setMode(mode)
		if activation == nvml.SUCCESS {
			changed()
		}
		return ret, activation
	}
	// Real NVML answers for profiles by index; an index the board lacks is
	// not supported, one past the enum invalid.
	d.GetGpuInstanceProfileInfoFunc = func(index int) (nvml.GpuInstanceProfileInfo, nvml.Return) {
		if index < 0 || index >= nvml.GPU_INSTANCE_PROFILE_COUNT {
			return nvml.GpuInstanceProfileInfo{}, nvml.ERROR_INVALID_ARGUMENT
		}
		info, ok := d.Config.MIGProfiles.GpuInstanceProfiles[index]
		if !ok {
			return nvml.GpuInstanceProfileInfo{}, nvml.ERROR_NOT_SUPPORTED
		}
		return info, nvml.SUCCESS
	}
	d.GetGpuInstancePossiblePlacementsFunc = func(info *nvml.GpuInstanceProfileInfo) ([]nvml.GpuInstancePlacement, nvml.Return) {
		if _, ok := table.ByID(int(info.Id)); !ok {
			return nil, nvml.ERROR_INVALID_ARGUMENT
		}
		return slices.Clone(d.Config.MIGProfiles.GpuInstancePlacements[int(info.Id)]), nvml.SUCCESS
	}
	d.GetGpuInstancesFunc = func(info *nvml.GpuInstanceProfileInfo) ([]nvml.GpuInstance, nvml.Return) {
		if _, ok := table.ByID(int(info.Id)); !ok {
			return nil, nvml.ERROR_INVALID_ARGUMENT
		}
		d.RLock()
		defer d.RUnlock()
		if d.MigMode != nvml.DEVICE_MIG_ENABLE {
			return nil, nvml.ERROR_INVALID_STATE
		}
		var gis []nvml.GpuInstance
		for gi := range d.GpuInstances {
			if gi.Info.ProfileId == info.Id {
				gis = append(gis, gi)
			}
		}
		return gis, nvml.SUCCESS
	}
	create := d.CreateGpuInstanceWithPlacementFunc
	d.CreateGpuInstanceWithPlacementFunc = func(info *nvml.GpuInstanceProfileInfo, pl *nvml.GpuInstancePlacement) (nvml.GpuInstance, nvml.Return) {
		log.add("%s CreateGpuInstance(profile=%d start=%d)", name, info.Id, pl.Start)
		if ret := canCreate(d, table, info, *pl); ret != nvml.SUCCESS {
			return nil, ret
		}
		// Real NVML gives a new instance the lowest free ID; the mock counts
		// up forever, which would run past the 15 IDs a GPU has.
		d.Lock()
		d.GpuInstanceCounter = lowestFreeID(d)
		d.Unlock()
		gi, ret := create(info, pl)
		if ret == nvml.SUCCESS {
			completeGI(gi.(*server.GpuInstance), name, log, changed)
			changed()
		}
		return gi, ret
	}
	// Without a placement, NVML picks the first free one.
	d.CreateGpuInstanceFunc = func(info *nvml.GpuInstanceProfileInfo) (nvml.GpuInstance, nvml.Return) {
		p, ok := table.ByID(int(info.Id))
		if !ok {
			return nil, nvml.ERROR_INVALID_ARGUMENT
		}
		ret := nvml.ERROR_INSUFFICIENT_RESOURCES
		for _, pl := range p.Placements() {
			np := nvml.GpuInstancePlacement{Start: uint32(pl.Start), Size: uint32(pl.Size)}
			if r := canCreate(d, table, info, np); r != nvml.SUCCESS {
				if r != nvml.ERROR_INSUFFICIENT_RESOURCES {
					return nil, r
				}
				continue
			}
			return d.CreateGpuInstanceWithPlacement(info, &np)
		}
		return nil, ret
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
	// restore recreates saved instances with their IDs, profiles and
	// placements, as the driver still holds them.
	return func(g savedGPU) error {
		d.Lock()
		d.MigMode = g.MigMode
		d.Unlock()
		for _, s := range g.Instances {
			info, ok := giProfile(d, s.Profile)
			if !ok {
				return fmt.Errorf("%s: saved GPU instance %d has profile %d, which the GPU lacks", name, s.ID, s.Profile)
			}
			d.Lock()
			d.GpuInstanceCounter = s.ID
			d.Unlock()
			created, ret := create(&info, &nvml.GpuInstancePlacement{Start: s.Start, Size: s.Size})
			if ret != nvml.SUCCESS {
				return fmt.Errorf("%s: restore GPU instance %d: %v", name, s.ID, ret)
			}
			gi := created.(*server.GpuInstance)
			completeGI(gi, name, log, changed)
			for _, c := range s.Compute {
				cinfo, ok := ciProfile(gi, c.Profile)
				if !ok {
					return fmt.Errorf("%s: saved compute instance %d of GPU instance %d has profile %d, which the instance lacks", name, c.ID, s.ID, c.Profile)
				}
				gi.Lock()
				gi.ComputeInstanceCounter = c.ID
				gi.Unlock()
				if _, ret := gi.CreateComputeInstance(&cinfo); ret != nvml.SUCCESS {
					return fmt.Errorf("%s: restore compute instance %d of GPU instance %d: %v", name, c.ID, s.ID, ret)
				}
			}
		}
		return nil
	}
}

// giProfile finds the GPU instance profile with NVML's profile ID id.
func giProfile(d *server.Device, id uint32) (nvml.GpuInstanceProfileInfo, bool) {
	for _, info := range d.Config.MIGProfiles.GpuInstanceProfiles {
		if info.Id == id {
			return info, true
		}
	}
	return nvml.GpuInstanceProfileInfo{}, false
}

// ciProfile finds the compute instance profile with NVML's profile ID id
// among those of gi's profile.
func ciProfile(gi *server.GpuInstance, id uint32) (nvml.ComputeInstanceProfileInfo, bool) {
	for _, info := range gi.MIGProfiles.ComputeInstanceProfiles[int(gi.Info.ProfileId)] {
		if info.Id == id {
			return info, true
		}
	}
	return nvml.ComputeInstanceProfileInfo{}, false
}

// canCreate says whether real NVML would create a GPU instance of the
// profile at the placement now: INVALID_STATE outside MIG mode,
// INVALID_ARGUMENT for a profile or placement the board does not document,
// INSUFFICIENT_RESOURCES over occupied memory slices or past the profile's
// instance count.
func canCreate(d *server.Device, table *gpumodel.MIG, info *nvml.GpuInstanceProfileInfo, pl nvml.GpuInstancePlacement) nvml.Return {
	p, ok := table.ByID(int(info.Id))
	if !ok {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	if !slices.Contains(p.Placements(), gpumodel.Placement{Start: int(pl.Start), Size: int(pl.Size)}) {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	d.RLock()
	defer d.RUnlock()
	if d.MigMode != nvml.DEVICE_MIG_ENABLE {
		return nvml.ERROR_INVALID_STATE
	}
	same := 0
	for gi := range d.GpuInstances {
		t := gi.Info.Placement
		if pl.Start < t.Start+t.Size && t.Start < pl.Start+pl.Size {
			return nvml.ERROR_INSUFFICIENT_RESOURCES
		}
		if gi.Info.ProfileId == info.Id {
			same++
		}
	}
	if same >= p.Instances {
		return nvml.ERROR_INSUFFICIENT_RESOURCES
	}
	return nvml.SUCCESS
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

func completeGI(gi *server.GpuInstance, name string, log *callLog, changed func()) {
	destroy := gi.DestroyFunc
	gi.DestroyFunc = func() nvml.Return {
		gi.RLock()
		busy := len(gi.ComputeInstances) > 0
		gi.RUnlock()
		log.add("%s DestroyGpuInstance(profile=%d start=%d)", name, gi.Info.ProfileId, gi.Info.Placement.Start)
		if busy {
			return nvml.ERROR_IN_USE
		}
		ret := destroy()
		if ret == nvml.SUCCESS {
			changed()
		}
		return ret
	}
	slicesOf := gi.MIGProfiles.ComputeInstanceProfiles[int(gi.Info.ProfileId)]
	giSlices := uint32(0)
	for _, c := range slicesOf {
		giSlices = max(giSlices, c.SliceCount)
	}
	createCI := gi.CreateComputeInstanceFunc
	gi.CreateComputeInstanceFunc = func(info *nvml.ComputeInstanceProfileInfo) (nvml.ComputeInstance, nvml.Return) {
		log.add("%s CreateComputeInstance(gi=%d profile=%d)", name, gi.Info.Id, info.Id)
		if _, ok := slicesOf[int(info.Id)]; !ok {
			return nil, nvml.ERROR_INVALID_ARGUMENT
		}
		gi.RLock()
		used := uint32(0)
		for ci := range gi.ComputeInstances {
			used += slicesOf[int(ci.Info.ProfileId)].SliceCount
		}
		gi.RUnlock()
		if used+info.SliceCount > giSlices {
			return nil, nvml.ERROR_INSUFFICIENT_RESOURCES
		}
		ci, ret := createCI(info)
		if ret == nvml.SUCCESS {
			c := ci.(*server.ComputeInstance)
			destroyCI := c.DestroyFunc
			c.DestroyFunc = func() nvml.Return {
				log.add("%s DestroyComputeInstance(gi=%d ci=%d)", name, gi.Info.Id, c.Info.Id)
				ret := destroyCI()
				if ret == nvml.SUCCESS {
					changed()
				}
				return ret
			}
			changed()
		}
		return ci, ret
	}
}

// createStatic sets up an operator's MIG layout: MIG mode on (as the
// operator's reset would leave it), then each instance with one compute
// instance spanning it.
func createStatic(d *server.Device, table *gpumodel.MIG, insts []StaticInstance) error {
	if table == nil {
		return fmt.Errorf("the GPU has no MIG")
	}
	d.Lock()
	d.MigMode = nvml.DEVICE_MIG_ENABLE
	d.Unlock()
	for _, s := range insts {
		info, ret := d.GetGpuInstanceProfileInfo(s.Index)
		if ret != nvml.SUCCESS {
			return fmt.Errorf("static MIG profile index %d: %v", s.Index, ret)
		}
		p, _ := table.ByIndex(s.Index)
		if !slices.Contains(p.Starts, s.Start) {
			return fmt.Errorf("static MIG profile %s has no placement at %d", p.Name, s.Start)
		}
		gi, ret := d.CreateGpuInstanceWithPlacement(&info, &nvml.GpuInstancePlacement{Start: uint32(s.Start), Size: uint32(p.Size)})
		if ret != nvml.SUCCESS {
			return fmt.Errorf("static MIG instance %s@%d: %v", p.Name, s.Start, ret)
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
