package checkpoint_test

import (
	"os"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/checkpoint/checkpointtest"
)

// TestEncodeV1WritesThePinnedFile holds the upgrade tests' stand-in for the
// first release to that release's own output: from the data testdata/v1.json
// was written from, it must write that file byte for byte (key set, order,
// checksum).
func TestEncodeV1WritesThePinnedFile(t *testing.T) {
	want, err := os.ReadFile("testdata/v1.json")
	if err != nil {
		t.Fatal(err)
	}
	got, err := checkpointtest.EncodeV1(checkpoint.Sample())
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(string(want), string(got)); diff != "" {
		t.Errorf("EncodeV1 differs from the first release's file (-testdata/v1.json +EncodeV1):\n%s", diff)
	}
}

// TestEncodeV1RefusesWhatTheFirstReleaseCouldNotHold: a file with a MIG
// partition or GPU settings never came from the first release.
func TestEncodeV1RefusesWhatTheFirstReleaseCouldNotHold(t *testing.T) {
	withMIG := checkpoint.Sample()
	c := withMIG.Claims["uid-1"]
	c.Devices = []checkpoint.Device{{Pool: "node-a", Device: "gpu-0-mig-1g.10gb-0", MIG: &checkpoint.MIGPartition{GPUUUID: "GPU-0"}}}
	withMIG.Claims = map[string]checkpoint.Claim{"uid-1": c}
	withGPUs := checkpoint.Sample()
	withGPUs.GPUs = map[string]checkpoint.GPUOriginal{"GPU-0": {}}
	for name, d := range map[string]checkpoint.Data{"MIG": withMIG, "GPU originals": withGPUs} {
		if _, err := checkpointtest.EncodeV1(d); err == nil || !strings.Contains(err.Error(), "first release") {
			t.Errorf("%s: got %v, want a refusal naming the first release", name, err)
		}
	}
}
