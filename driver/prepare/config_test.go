package prepare_test

import (
	"context"
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/runtime"
)

func withConfig(c *resourceapi.ResourceClaim, driver, raw string) *resourceapi.ResourceClaim {
	c.Status.Allocation.Devices.Config = append(c.Status.Allocation.Devices.Config, resourceapi.DeviceAllocationConfiguration{
		Source: resourceapi.AllocationConfigSourceClaim,
		DeviceConfiguration: resourceapi.DeviceConfiguration{Opaque: &resourceapi.OpaqueDeviceConfiguration{
			Driver: driver, Parameters: runtime.RawExtension{Raw: []byte(raw)},
		}},
	})
	return c
}

func TestPrepareChecksOpaqueConfigs(t *testing.T) {
	m := newEnv(t, "pcie-l4x4").start()
	ctx := context.Background()
	for _, tc := range []struct {
		name, driver, raw, wantErr string
	}{
		{"exclusive", "gpu.tessera.dev", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"Exclusive"}}`, ""},
		{"other driver", "nic.example.com", `not even json`, ""},
		{"malformed", "gpu.tessera.dev", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"Sometimes"}}`, "sharing.strategy"},
		{"unknown field", "gpu.tessera.dev", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","colour":"green"}`, `unknown field "colour"`},
		{"MPS without a daemon image", "gpu.tessera.dev", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS"}}`, "--mps-image"},
		{"power beyond the board", "gpu.tessera.dev", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","powerLimitWatts":20}`, "powerLimitWatts 20 is outside the GPU's range 40..72 W"},
	} {
		c := withConfig(claim("cfg-"+strings.ReplaceAll(tc.name, " ", "-"), "gpu-0"), tc.driver, tc.raw)
		_, err := m.Prepare(ctx, c)
		switch {
		case tc.wantErr == "" && err != nil:
			t.Errorf("%s: %v", tc.name, err)
		case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
			t.Errorf("%s: got %v, want an error containing %q", tc.name, err, tc.wantErr)
		}
		if err == nil {
			if err := m.Unprepare(ctx, c.UID); err != nil {
				t.Fatal(err)
			}
		}
	}
	if len(m.PreparedClaims()) != 0 {
		t.Errorf("refused claims hold devices: %v", m.PreparedClaims())
	}
}
