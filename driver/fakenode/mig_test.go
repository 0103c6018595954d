package fakenode_test

import (
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/tessera-dev/tessera/driver/fakenode"
)

// TestFakeMIGRefusesWhatNVMLRefuses: the simulated GPU answers MIG calls
// with the errors real NVML returns, from the model's table.
func TestFakeMIGRefusesWhatNVMLRefuses(t *testing.T) {
	h100 := node(t, "dgx-h100")
	d, _ := h100.Server.DeviceGetHandleByIndex(0)
	info := func(index int) nvml.GpuInstanceProfileInfo {
		p, ret := d.GetGpuInstanceProfileInfo(index)
		if ret != nvml.SUCCESS {
			t.Fatalf("profile index %d: %v", index, ret)
		}
		return p
	}
	create := func(index, start, size int) nvml.Return {
		p := info(index)
		gi, ret := d.CreateGpuInstanceWithPlacement(&p, &nvml.GpuInstancePlacement{Start: uint32(start), Size: uint32(size)})
		if ret == nvml.SUCCESS {
			cp, r := gi.GetComputeInstanceProfileInfo(0, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
			if r != nvml.SUCCESS {
				t.Fatal(r)
			}
			for _, ci := range []int{0, 1} { // the second must be refused on a 1-slice instance
				_, r := gi.CreateComputeInstance(&cp)
				if want := map[int]nvml.Return{0: nvml.SUCCESS, 1: nvml.ERROR_INSUFFICIENT_RESOURCES}[ci]; p.SliceCount == 1 && r != want {
					t.Errorf("compute instance %d on a 1g instance: %v, want %v", ci, r, want)
				}
			}
		}
		return ret
	}
	if p := info(nvml.GPU_INSTANCE_PROFILE_1_SLICE); p.Id != 19 {
		t.Errorf("1g.10gb reports ID %d, real NVML 19", p.Id)
	}
	if _, ret := d.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_1_SLICE_GFX); ret != nvml.ERROR_NOT_SUPPORTED {
		t.Errorf("a profile the H100 lacks: %v, want NOT_SUPPORTED", ret)
	}
	if ret := create(nvml.GPU_INSTANCE_PROFILE_1_SLICE, 0, 1); ret != nvml.ERROR_INVALID_STATE {
		t.Errorf("create outside MIG mode: %v, want INVALID_STATE", ret)
	}
	if ret, act := d.SetMigMode(nvml.DEVICE_MIG_ENABLE); ret != nvml.SUCCESS || act != nvml.SUCCESS {
		t.Fatalf("Hopper enters MIG mode without a reset: %v %v", ret, act)
	}
	for _, tc := range []struct {
		what               string
		index, start, size int
		want               nvml.Return
	}{
		{"1g.20gb at start 1 (starts are 0, 2, 4, 6)", nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV2, 1, 2, nvml.ERROR_INVALID_ARGUMENT},
		{"3g.40gb with size 3 (size is 4)", nvml.GPU_INSTANCE_PROFILE_3_SLICE, 0, 3, nvml.ERROR_INVALID_ARGUMENT},
		{"1g.10gb+me at 0", nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1, 0, 1, nvml.SUCCESS},
		{"a second 1g.10gb+me (one instance)", nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1, 1, 1, nvml.ERROR_INSUFFICIENT_RESOURCES},
		{"3g.40gb at 4", nvml.GPU_INSTANCE_PROFILE_3_SLICE, 4, 4, nvml.SUCCESS},
		{"1g.10gb at 6, inside the 3g", nvml.GPU_INSTANCE_PROFILE_1_SLICE, 6, 1, nvml.ERROR_INSUFFICIENT_RESOURCES},
		{"2g.20gb at 2", nvml.GPU_INSTANCE_PROFILE_2_SLICE, 2, 2, nvml.SUCCESS},
		{"1g.20gb at 0 overlaps the +me", nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV2, 0, 2, nvml.ERROR_INSUFFICIENT_RESOURCES},
		{"1g.10gb at 1", nvml.GPU_INSTANCE_PROFILE_1_SLICE, 1, 1, nvml.SUCCESS},
	} {
		if ret := create(tc.index, tc.start, tc.size); ret != tc.want {
			t.Errorf("%s: %v, want %v", tc.what, ret, tc.want)
		}
	}
	if ret, _ := d.SetMigMode(nvml.DEVICE_MIG_DISABLE); ret != nvml.ERROR_IN_USE {
		t.Errorf("leaving MIG mode with instances: %v, want IN_USE", ret)
	}

	a100 := node(t, "dgx-a100")
	a, _ := a100.Server.DeviceGetHandleByIndex(0)
	if _, act := a.SetMigMode(nvml.DEVICE_MIG_ENABLE); act != nvml.ERROR_RESET_REQUIRED {
		t.Errorf("Ampere enters MIG mode without a reset: activation %v, want RESET_REQUIRED", act)
	}
	l4 := node(t, "pcie-l4x4")
	l, _ := l4.Server.DeviceGetHandleByIndex(0)
	if _, _, ret := l.GetMigMode(); ret != nvml.ERROR_NOT_SUPPORTED {
		t.Errorf("L4 MIG mode: %v, want NOT_SUPPORTED", ret)
	}
}

func node(t *testing.T, profile string) *fakenode.Node {
	t.Helper()
	n, err := fakenode.New(profile, fakenode.Options{Dir: t.TempDir(), NodeName: "node-a"})
	if err != nil {
		t.Fatal(err)
	}
	return n
}
