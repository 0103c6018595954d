package fakenode

import (
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// TestRebootLosesMIGInstancesAndSettings: after a reboot no MIG instance the
// driver created is left, settings are at their defaults, MIG mode stays.
func TestRebootLosesMIGInstancesAndSettings(t *testing.T) {
	n, err := New("dgx-h100", Options{Dir: t.TempDir(), NodeName: "n"})
	if err != nil {
		t.Fatal(err)
	}
	d, ret := n.NVML.DeviceGetHandleByIndex(0)
	if ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	if _, ret := d.SetMigMode(nvml.DEVICE_MIG_ENABLE); ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	info, ret := d.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_1_SLICE)
	if ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	if _, ret := d.CreateGpuInstanceWithPlacement(&info, &nvml.GpuInstancePlacement{Start: 0, Size: 1}); ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	before := n.PowerLimitMW(0)
	if ret := d.SetPowerManagementLimit(before - 100000); ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	if ret := d.SetComputeMode(nvml.COMPUTEMODE_EXCLUSIVE_PROCESS); ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	if got := n.GPUInstances(0); got != 1 {
		t.Fatalf("%d GPU instances before the reboot, want 1", got)
	}
	if err := n.Reboot(); err != nil {
		t.Fatal(err)
	}
	if got := n.GPUInstances(0); got != 0 {
		t.Errorf("%d GPU instances after the reboot, want 0", got)
	}
	if got := n.PowerLimitMW(0); got != before {
		t.Errorf("power limit %d mW after the reboot, want the default %d", got, before)
	}
	if got := n.ComputeMode(0); got != nvml.COMPUTEMODE_DEFAULT {
		t.Errorf("compute mode %v after the reboot, want Default", got)
	}
	if mode, _, ret := d.GetMigMode(); ret != nvml.SUCCESS || mode != nvml.DEVICE_MIG_ENABLE {
		t.Errorf("MIG mode %d (%v) after the reboot, want still enabled", mode, ret)
	}
}
