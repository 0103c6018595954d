package checkpoint

import (
	"errors"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestClaimRecordRoundTrips(t *testing.T) {
	mode, mw := "Prohibited", uint32(700000)
	want := ClaimRecord{
		Claim: Claim{Namespace: "ml", Name: "infer", Phase: PrepareCompleted, MPS: &MPSDaemon{Pod: "tessera-mps-uid-1", Dir: "/var/lib/mps/uid-1"}, Devices: []Device{{
			Requests: []string{"gpu"}, Pool: "node-a", Device: "gpu-0-mig-1g10gb-6", CDIDeviceIDs: []string{"gpu.tessera.dev/gpu=uid-1-gpu-0-mig-1g10gb-6"},
			MIG:     &MIGPartition{GPUUUID: "GPU-0", ProfileIndex: 0, Start: 6, Size: 1, Switchable: true, GPUInstance: 13, ComputeInstance: 0, UUID: "MIG-1"},
			ShareID: "share-1", MemoryBytes: 10 << 30, GPU: "GPU-0", Settings: &Settings{ComputeMode: "Default", PowerLimitMW: 400000},
		}}},
		GPUs: map[string]GPUOriginal{"GPU-0": {ComputeMode: &mode, PowerLimitMW: &mw}},
	}
	raw, err := EncodeClaimRecord(want)
	if err != nil {
		t.Fatal(err)
	}
	got, err := DecodeClaimRecord(raw)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("round trip (-want +got):\n%s", diff)
	}
}

func TestClaimRecordOfAnotherVersionOrDamaged(t *testing.T) {
	for _, tt := range []struct {
		raw, want string
		corrupt   bool
	}{
		{`{"version":1,"claim":{"name":"a","phase":"PrepareCompleted","future":1},"later":true}`, "", false},
		{`{"version":2,"claim":{"name":"a","phase":"PrepareCompleted"}}`, "newer than this plugin's", false},
		{`{"claim":{"name":"a","phase":"PrepareCompleted"}}`, "missing or invalid version", true},
		{`{"version":1,"claim":{"name":"a","phase":"Prepared"}}`, "unknown phase", true},
		{`{"version":1,"claim":{"na`, "claim record", true},
	} {
		_, err := DecodeClaimRecord(tt.raw)
		if tt.want == "" {
			if err != nil {
				t.Errorf("%s: %v, want fields of a newer minor version ignored", tt.raw, err)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), tt.want) || errors.Is(err, ErrCorrupt) != tt.corrupt {
			t.Errorf("%s: got %v, want an error saying %q (corrupt: %v)", tt.raw, err, tt.want, tt.corrupt)
		}
	}
}
