package fakenode_test

import (
	"fmt"
	"slices"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/tessera-dev/tessera/driver/fakenode"
)

// migLayout is what NVML reports of a GPU's MIG state: its mode, and each
// GPU instance (ID, profile ID, placement) with its compute instances'
// IDs and the MIG devices' UUIDs.
func migLayout(t *testing.T, n *fakenode.Node, gpu int) (mode int, instances []string, uuids []string) {
	t.Helper()
	d, ret := n.NVML.DeviceGetHandleByIndex(gpu)
	if ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	mode, _, ret = d.GetMigMode()
	if ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	for index := range nvml.GPU_INSTANCE_PROFILE_COUNT {
		p, ret := d.GetGpuInstanceProfileInfo(index)
		if ret != nvml.SUCCESS {
			continue
		}
		gis, ret := d.GetGpuInstances(&p)
		if ret != nvml.SUCCESS {
			continue
		}
		for _, gi := range gis {
			info, _ := gi.GetInfo()
			desc := fmt.Sprintf("gi%d profile=%d at %d+%d", info.Id, info.ProfileId, info.Placement.Start, info.Placement.Size)
			for cindex := range nvml.COMPUTE_INSTANCE_PROFILE_COUNT {
				cp, ret := gi.GetComputeInstanceProfileInfo(cindex, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
				if ret != nvml.SUCCESS {
					continue
				}
				cis, _ := gi.GetComputeInstances(&cp)
				for _, ci := range cis {
					cinfo, _ := ci.GetInfo()
					desc += fmt.Sprintf(" ci%d profile=%d", cinfo.Id, cinfo.ProfileId)
				}
			}
			instances = append(instances, desc)
		}
	}
	slices.Sort(instances) // NVML lists them in no particular order
	count, _ := d.GetMaxMigDeviceCount()
	for i := range count {
		m, ret := d.GetMigDeviceHandleByIndex(i)
		if ret != nvml.SUCCESS {
			break
		}
		u, _ := m.GetUUID()
		uuids = append(uuids, u)
	}
	return mode, instances, uuids
}

// TestMIGStateOutlivesTheProcessThatMadeIt: the NVIDIA driver keeps MIG
// mode and instances, power limits and compute modes until a reboot,
// whichever process set them. A fake node that persists, opened again over
// the same directory (another plugin process), finds the same instances
// with the same IDs, profiles, placements and MIG UUIDs, and the same
// settings; an instance destroyed there is gone for the next; a reboot
// clears instances and settings. A node that does not persist starts
// afresh.
func TestMIGStateOutlivesTheProcessThatMadeIt(t *testing.T) {
	dir := t.TempDir()
	open := func(persist bool) *fakenode.Node {
		n, err := fakenode.New("dgx-h100", fakenode.Options{Dir: dir, NodeName: "node-a", Persist: persist})
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	first := open(true)
	d, _ := first.NVML.DeviceGetHandleByIndex(3)
	if ret, _ := d.SetMigMode(nvml.DEVICE_MIG_ENABLE); ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	for _, c := range []struct{ index, start, size int }{{nvml.GPU_INSTANCE_PROFILE_1_SLICE, 6, 1}, {nvml.GPU_INSTANCE_PROFILE_3_SLICE, 0, 4}, {nvml.GPU_INSTANCE_PROFILE_1_SLICE, 5, 1}} {
		p, ret := d.GetGpuInstanceProfileInfo(c.index)
		if ret != nvml.SUCCESS {
			t.Fatal(ret)
		}
		gi, ret := d.CreateGpuInstanceWithPlacement(&p, &nvml.GpuInstancePlacement{Start: uint32(c.start), Size: uint32(c.size)})
		if ret != nvml.SUCCESS {
			t.Fatalf("create %+v: %v", c, ret)
		}
		cp, ret := gi.GetComputeInstanceProfileInfo(nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
		if ret != nvml.SUCCESS {
			t.Fatal(ret)
		}
		if _, ret := gi.CreateComputeInstance(&cp); ret != nvml.SUCCESS {
			t.Fatal(ret)
		}
	}
	// Destroy the second instance, so that the IDs in use have a gap.
	p, _ := d.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_3_SLICE)
	gis, _ := d.GetGpuInstances(&p)
	destroyAll(t, gis[0])
	// GPU settings an administrator (or the plugin, for a claim) changed.
	d2, _ := first.NVML.DeviceGetHandleByIndex(2)
	defaultMW, _ := d2.GetPowerManagementLimit()
	if ret := d2.SetPowerManagementLimit(defaultMW - 100000); ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	if ret := d2.SetComputeMode(nvml.COMPUTEMODE_EXCLUSIVE_PROCESS); ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	wantMode, want, wantUUIDs := migLayout(t, first, 3)
	if len(want) != 2 || len(wantUUIDs) != 2 {
		t.Fatalf("first process: instances %v, MIG devices %v, want two of each", want, wantUUIDs)
	}

	second := open(true)
	mode, got, uuids := migLayout(t, second, 3)
	if mode != wantMode || !slices.Equal(got, want) || !slices.Equal(uuids, wantUUIDs) {
		t.Errorf("another process finds mode %d, instances %v, MIG devices %v; want %d, %v, %v", mode, got, uuids, wantMode, want, wantUUIDs)
	}
	if mw, mode := second.PowerLimitMW(2), second.ComputeMode(2); mw != defaultMW-100000 || mode != nvml.COMPUTEMODE_EXCLUSIVE_PROCESS {
		t.Errorf("another process finds gpu-2 at %d mW in compute mode %d, want %d mW and exclusive-process (%d)", mw, mode, defaultMW-100000, nvml.COMPUTEMODE_EXCLUSIVE_PROCESS)
	}
	if len(second.Calls()) != 0 {
		t.Errorf("another process starts with calls %v recorded, want none", second.Calls())
	}
	d3, _ := second.NVML.DeviceGetHandleByIndex(3)
	p1, _ := d3.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_1_SLICE)
	gis, _ = d3.GetGpuInstances(&p1)
	destroyAll(t, gis[0])

	third := open(true)
	if n := third.GPUInstances(3); n != 1 {
		t.Errorf("after one of two instances was destroyed by another process, the next finds %d, want 1", n)
	}
	if err := third.Reboot(); err != nil {
		t.Fatal(err)
	}
	rebooted := open(true)
	if n := rebooted.GPUInstances(3); n != 0 {
		t.Errorf("after a reboot, a new process finds %d GPU instances, want 0", n)
	}
	if mw, mode := rebooted.PowerLimitMW(2), rebooted.ComputeMode(2); mw != defaultMW || mode != nvml.COMPUTEMODE_DEFAULT {
		t.Errorf("after a reboot gpu-2 is at %d mW in compute mode %d, want the defaults %d mW and %d", mw, mode, defaultMW, nvml.COMPUTEMODE_DEFAULT)
	}
	if mode, _, _ := migLayout(t, open(true), 3); mode != nvml.DEVICE_MIG_ENABLE {
		t.Errorf("after a reboot MIG mode is %d, want it kept (a persistent setting)", mode)
	}
	if mode, _, _ := migLayout(t, open(false), 3); mode != nvml.DEVICE_MIG_DISABLE {
		t.Errorf("a node that does not persist starts with MIG mode %d, want the profile's default (off)", mode)
	}
}

// destroyAll destroys a GPU instance's compute instances, then it.
func destroyAll(t *testing.T, gi nvml.GpuInstance) {
	t.Helper()
	for cindex := range nvml.COMPUTE_INSTANCE_PROFILE_COUNT {
		cp, ret := gi.GetComputeInstanceProfileInfo(cindex, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
		if ret != nvml.SUCCESS {
			continue
		}
		cis, _ := gi.GetComputeInstances(&cp)
		for _, ci := range cis {
			if ret := ci.Destroy(); ret != nvml.SUCCESS {
				t.Fatal(ret)
			}
		}
	}
	if ret := gi.Destroy(); ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
}
