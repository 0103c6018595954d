package prepare_test

import (
	"context"
	"encoding/json"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/google/go-cmp/cmp"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/utils/ptr"

	"github.com/tessera-dev/tessera/cdi"
	"github.com/tessera-dev/tessera/driver/discovery"
	"github.com/tessera-dev/tessera/driver/inventory"
)

// A checkpoint rebuilt from the CDI specs holds every field the lost one
// held: a running pod's MPS daemon is still known (and not swept), GPU
// settings are still restored at unprepare, shares stay shares (new ones
// still fit beside them), and the kubelet's repeated prepare of each claim
// is answered as before.
func TestCorruptCheckpointIsRebuiltWithEveryField(t *testing.T) {
	e := newEnv(t, "dgx-h100")
	e.share = func(g discovery.GPU) inventory.Share { return inventory.Share{Memory: g.Index == 2} }
	mps := &fakeMPS{dir: t.TempDir()}
	e.mps = mps
	// An operator's compute mode, which the MPS claim changes and its
	// unprepare must put back.
	if ret := e.node.Server.Devices[4].SetComputeMode(nvml.COMPUTEMODE_PROHIBITED); ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	ctx := context.Background()
	claims := []*resourceapi.ResourceClaim{
		claim("whole", "gpu-1"),
		claim("mig", part),
		shared(claim("share-a", "gpu-2"), "20Gi"),
		shared(claim("share-b", "gpu-2"), "30Gi"),
		gpuConfig(claim("capped", "gpu-3"), `"powerLimitWatts":400`),
		gpuConfig(claim("mps", "gpu-4"), `"sharing":{"strategy":"MPS","mpsConfig":{"defaultActiveThreadPercentage":50}}`),
	}
	m := e.start()
	prepared := map[string][]string{}
	for _, c := range claims {
		devs, err := m.Prepare(ctx, c)
		if err != nil {
			t.Fatalf("prepare %s: %v", c.Name, err)
		}
		prepared[c.Name] = devs[0].CDIDeviceIDs
	}
	before, beforeGPUs := m.PreparedClaims(), load(t, e.dataDir).GPUs
	if len(beforeGPUs) == 0 {
		t.Fatal("no GPU settings recorded before the checkpoint was lost")
	}

	writeJunk(t, e.dataDir)
	m = e.start()
	if diff := cmp.Diff(before, m.PreparedClaims()); diff != "" {
		t.Errorf("rebuilt claims (-lost +rebuilt):\n%s", diff)
	}
	if diff := cmp.Diff(beforeGPUs, load(t, e.dataDir).GPUs); diff != "" {
		t.Errorf("rebuilt GPU settings to restore (-lost +rebuilt):\n%s", diff)
	}
	if got := mps.Running(); !slices.Equal(got, []string{"tessera-mps-uid-mps"}) {
		t.Errorf("MPS daemons running after the rebuild: %v", got)
	}

	// The kubelet prepares every claim again, and gets what it got.
	for _, c := range claims {
		devs, err := m.Prepare(ctx, c)
		if err != nil {
			t.Errorf("repeated prepare of %s after the rebuild: %v", c.Name, err)
			continue
		}
		if !slices.Equal(devs[0].CDIDeviceIDs, prepared[c.Name]) {
			t.Errorf("repeated prepare of %s: CDI IDs %v, want %v", c.Name, devs[0].CDIDeviceIDs, prepared[c.Name])
		}
	}
	// gpu-2's memory is shared, 50 GiB of it held: what is left fits, no more.
	left := resource.NewQuantity(e.gpus[2].MemoryBytes-50<<30, resource.BinarySI).String()
	fits := shared(claim("share-c", "gpu-2"), left)
	if _, err := m.Prepare(ctx, fits); err != nil {
		t.Errorf("a share of the %s left beside the rebuilt ones: %v", left, err)
	}
	if _, err := m.Prepare(ctx, shared(claim("share-d", "gpu-2"), "1Gi")); err == nil || !strings.Contains(err.Error(), "more than the GPU's") {
		t.Errorf("a share past gpu-2's memory: %v, want refused", err)
	}

	for _, c := range append(claims, fits) {
		if err := m.Unprepare(ctx, c.UID); err != nil {
			t.Fatalf("unprepare %s: %v", c.Name, err)
		}
	}
	if got := e.node.PowerLimitMW(3); got != 700000 {
		t.Errorf("gpu-3 power limit after unprepare: %d mW, want the original 700000", got)
	}
	if got := e.node.ComputeMode(4); got != nvml.COMPUTEMODE_PROHIBITED {
		t.Errorf("gpu-4 compute mode after unprepare: %d, want the operator's Prohibited", got)
	}
	if got := mps.Running(); len(got) != 0 {
		t.Errorf("MPS daemons left running: %v", got)
	}
	if d := load(t, e.dataDir); len(d.Claims) != 0 || len(d.GPUs) != 0 {
		t.Errorf("checkpoint after unprepare: claims %+v, GPU settings %+v", d.Claims, d.GPUs)
	}
	if f := specFiles(t, e.cdiDir); len(f) != 0 {
		t.Errorf("CDI specs left: %v", f)
	}
	if n := e.node.GPUInstances(0); n != 0 {
		t.Errorf("%d MIG instances left on gpu-0", n)
	}
}

// A spec written before specs carried the claim's record is rebuilt from
// what it shows. What it cannot tell is left as it is, never undone: the
// MPS daemon its pods use is kept (its mounts show it), and stopped when
// the claim is unprepared.
func TestCorruptCheckpointKeepsTheMPSDaemonOfASpecWithoutARecord(t *testing.T) {
	e, mps, c := mpsPrepared(t, "old", "gpu-4")
	ctx := context.Background()
	loseCheckpointOfEarlierRelease(t, e, string(c.UID))

	m := e.start()
	got, ok := m.PreparedClaims()[c.UID]
	if !ok || got.MPS == nil || *got.MPS != mps.Locate(string(c.UID)) {
		t.Fatalf("rebuilt claim %+v (present %v), want its MPS daemon %+v known", got, ok, mps.Locate(string(c.UID)))
	}
	if err := m.Unprepare(ctx, c.UID); err != nil {
		t.Fatal(err)
	}
	if got := mps.Running(); len(got) != 0 {
		t.Errorf("MPS daemons left running after unprepare: %v", got)
	}
}

// loseCheckpointOfEarlierRelease makes the claims' specs as an earlier
// release wrote them (no record) and corrupts the checkpoint.
func loseCheckpointOfEarlierRelease(t *testing.T, e *env, uids ...string) {
	t.Helper()
	store, err := cdi.NewStore(e.cdiDir)
	if err != nil {
		t.Fatal(err)
	}
	for _, uid := range uids {
		dropRecord(t, store.Path(uid))
	}
	writeJunk(t, e.dataDir)
}

// dropRecord rewrites a CDI spec as releases before the claim record wrote
// it.
func dropRecord(t *testing.T, path string) {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var spec map[string]any
	if err := json.Unmarshal(raw, &spec); err != nil {
		t.Fatal(err)
	}
	delete(spec["annotations"].(map[string]any), cdi.Vendor+"/claim-record")
	if raw, err = json.Marshal(spec); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, raw, 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestASpecWithoutARecordRebuildsItsPartitionByItsUUID: a partition claim
// whose spec carries no record (an earlier release's) is rebuilt with the
// partition's UUID the spec gave the container, so its unprepare destroys
// that partition rather than leave it behind.
func TestASpecWithoutARecordRebuildsItsPartitionByItsUUID(t *testing.T) {
	e := newEnv(t, "dgx-h100")
	ctx := context.Background()
	c := claim("old", part)
	if _, err := e.start().Prepare(ctx, c); err != nil {
		t.Fatal(err)
	}
	loseCheckpointOfEarlierRelease(t, e, string(c.UID))

	m := e.start()
	if err := m.Unprepare(ctx, c.UID); err != nil {
		t.Fatal(err)
	}
	if n := e.node.GPUInstances(0); n != 0 {
		t.Errorf("GPU 0 keeps %d partitions after the rebuilt claim's unprepare, want none", n)
	}
}

// TestSpecsWithoutARecordNamingOneDeviceRebuildNoOwner: an owner's and an
// admin-access observer's spec of one partition, both of an earlier release
// (no record), look alike; rebuilt, neither holds the partition nor
// destroys it, whichever is unprepared first.
func TestSpecsWithoutARecordNamingOneDeviceRebuildNoOwner(t *testing.T) {
	e := newEnv(t, "dgx-h100")
	ctx := context.Background()
	m := e.start()
	if _, err := m.Prepare(ctx, claim("holder", part)); err != nil {
		t.Fatal(err)
	}
	monitor := claim("monitor", part)
	monitor.Status.Allocation.Devices.Results[0].AdminAccess = ptr.To(true)
	if _, err := m.Prepare(ctx, monitor); err != nil {
		t.Fatal(err)
	}
	loseCheckpointOfEarlierRelease(t, e, "uid-holder", "uid-monitor")

	m = e.start()
	for uid, c := range m.PreparedClaims() {
		if d := c.Devices[0]; !d.AdminAccess || d.MIG != nil {
			t.Errorf("claim %s rebuilt holding %s (admin access %v, MIG record %+v), want it observed", uid, d.Device, d.AdminAccess, d.MIG)
		}
	}
	if err := m.Unprepare(ctx, monitor.UID); err != nil {
		t.Fatal(err)
	}
	if n := e.node.GPUInstances(0); n != 1 {
		t.Errorf("GPU 0 has %d partitions after the observer's unprepare, want the holder's", n)
	}
}
