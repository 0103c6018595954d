package prepare_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"k8s.io/klog/v2"
	"k8s.io/klog/v2/ktesting"

	"github.com/tessera-dev/tessera/driver/checkpoint"
)

func load(t *testing.T, dir string) checkpoint.Data {
	t.Helper()
	s, _ := checkpoint.NewStore(dir)
	d, err := s.Load()
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func save(t *testing.T, dir string, d checkpoint.Data) {
	t.Helper()
	s, _ := checkpoint.NewStore(dir)
	if err := s.Save(d); err != nil {
		t.Fatal(err)
	}
}

func TestRestartKeepsPreparedClaims(t *testing.T) {
	e := newEnv(t, "dgx-h100")
	ctx := context.Background()
	devs, err := e.start().Prepare(ctx, claim("keep", "gpu-1"))
	if err != nil {
		t.Fatal(err)
	}
	m := e.start()
	again, err := m.Prepare(ctx, claim("keep", "gpu-1"))
	if err != nil || again[0].CDIDeviceIDs[0] != devs[0].CDIDeviceIDs[0] {
		t.Fatalf("after restart: %+v %v", again, err)
	}
	if _, err := m.Prepare(ctx, claim("thief", "gpu-1")); err == nil {
		t.Fatal("a restarted plugin forgot who holds gpu-1")
	}
}

func TestRestartRollsBackAnInterruptedPrepare(t *testing.T) {
	e := newEnv(t, "dgx-h100")
	ctx := context.Background()
	if _, err := e.start().Prepare(ctx, claim("half", "gpu-4")); err != nil {
		t.Fatal(err)
	}
	// Simulate a crash after the CDI write but before the completed mark.
	d := load(t, e.dataDir)
	c := d.Claims["uid-half"]
	c.Phase = checkpoint.PrepareStarted
	d.Claims["uid-half"] = c
	save(t, e.dataDir, d)

	m := e.start()
	if f := specFiles(t, e.cdiDir); len(f) != 0 {
		t.Errorf("rolled-back claim left specs: %v", f)
	}
	if len(m.PreparedClaims()) != 0 {
		t.Errorf("claims after rollback: %v", m.PreparedClaims())
	}
	if _, err := m.Prepare(ctx, claim("other", "gpu-4")); err != nil {
		t.Fatalf("gpu-4 not released by the rollback: %v", err)
	}
}

func TestRestartFinishesAnInterruptedUnprepare(t *testing.T) {
	e := newEnv(t, "dgx-h100")
	if _, err := e.start().Prepare(context.Background(), claim("going", "gpu-0")); err != nil {
		t.Fatal(err)
	}
	d := load(t, e.dataDir)
	c := d.Claims["uid-going"]
	c.Phase = checkpoint.UnprepareStarted
	d.Claims["uid-going"] = c
	save(t, e.dataDir, d)
	m := e.start()
	if len(m.PreparedClaims()) != 0 || len(specFiles(t, e.cdiDir)) != 0 {
		t.Errorf("unprepare not finished: claims %v specs %v", m.PreparedClaims(), specFiles(t, e.cdiDir))
	}
}

func TestCorruptCheckpointIsRebuiltFromCDISpecs(t *testing.T) {
	e := newEnv(t, "dgx-h100")
	ctx := context.Background()
	m := e.start()
	for _, c := range []struct{ name, dev string }{{"a", "gpu-0"}, {"b", "gpu-6"}} {
		if _, err := m.Prepare(ctx, claim(c.name, c.dev)); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(e.dataDir, checkpoint.FileName), []byte(`{"version":1,"checks`), 0o600); err != nil {
		t.Fatal(err)
	}
	m = e.start() // must not fail: recovers instead of crash-looping
	got := m.PreparedClaims()
	if len(got) != 2 || got["uid-a"].Name != "a" || got["uid-b"].Devices[0].Device != "gpu-6" {
		t.Fatalf("rebuilt claims %+v", got)
	}
	if _, err := m.Prepare(ctx, claim("thief", "gpu-6")); err == nil || !strings.Contains(err.Error(), "default/b") {
		t.Fatalf("rebuilt state lost ownership of gpu-6: %v", err)
	}
	moved, _ := filepath.Glob(filepath.Join(e.dataDir, checkpoint.FileName+".corrupt-*"))
	if len(moved) != 1 {
		t.Errorf("corrupted checkpoint not kept aside: %v", moved)
	}
	if err := m.Unprepare(ctx, "uid-a"); err != nil {
		t.Fatal(err)
	}
	if d := load(t, e.dataDir); len(d.Claims) != 1 {
		t.Errorf("checkpoint after unprepare: %+v", d)
	}
}

// A checkpoint lost across a reboot (torn by the power cut) must not bring
// back the earlier boot's claims from a CDI directory that is not tmpfs.
func TestCorruptCheckpointAfterARebootLeavesTheEarlierBootsSpecsOut(t *testing.T) {
	e := newEnv(t, "dgx-h100")
	ctx := context.Background()
	m := e.start()
	if _, err := m.Prepare(ctx, claim("old", "gpu-3")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(e.dataDir, checkpoint.FileName), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	e.bootID = "boot-2"
	m = e.start()
	if got := m.PreparedClaims(); len(got) != 0 {
		t.Errorf("claims rebuilt from the earlier boot's specs: %+v", got)
	}
	if f := specFiles(t, e.cdiDir); len(f) != 0 {
		t.Errorf("the earlier boot's specs are still there: %v", f)
	}
	if _, err := m.Prepare(ctx, claim("new", "gpu-3")); err != nil {
		t.Errorf("gpu-3 still held by the earlier boot's claim: %v", err)
	}
	if d := load(t, e.dataDir); d.BootID != "boot-2" || len(d.Claims) != 1 {
		t.Errorf("checkpoint %+v, want boot-2 with the new claim only", d)
	}
}

func TestRebootDiscardsStaleState(t *testing.T) {
	e := newEnv(t, "dgx-h100")
	ctx := context.Background()
	if _, err := e.start().Prepare(ctx, claim("old", "gpu-2")); err != nil {
		t.Fatal(err)
	}
	e.bootID = "boot-2"
	m := e.start()
	if len(m.PreparedClaims()) != 0 || len(specFiles(t, e.cdiDir)) != 0 {
		t.Fatalf("stale state survived a reboot: %v %v", m.PreparedClaims(), specFiles(t, e.cdiDir))
	}
	if d := load(t, e.dataDir); d.BootID != "boot-2" {
		t.Errorf("checkpoint boot ID %q", d.BootID)
	}
	// The kubelet re-prepares after the reboot.
	if _, err := m.Prepare(ctx, claim("old", "gpu-2")); err != nil {
		t.Fatal(err)
	}
}

func TestOrphanSpecsAreRemovedAtStart(t *testing.T) {
	e := newEnv(t, "dgx-h100")
	if _, err := e.start().Prepare(context.Background(), claim("orphan", "gpu-3")); err != nil {
		t.Fatal(err)
	}
	save(t, e.dataDir, checkpoint.Data{BootID: e.bootID})
	e.start()
	if f := specFiles(t, e.cdiDir); len(f) != 0 {
		t.Errorf("orphan spec kept: %v", f)
	}
}

func writeJunk(t *testing.T, dir string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, checkpoint.FileName), []byte("{\x00junk"), 0o600); err != nil {
		t.Fatal(err)
	}
}

// In a rolling update every call starts by reloading the checkpoint. A
// corrupted one is rebuilt there as at start (moved aside, claims rebuilt
// from the CDI specs, the rebuilt file written for the other instance),
// so calls keep being served instead of failing until a restart.
func TestReloadRebuildsACorruptCheckpointFromCDISpecs(t *testing.T) {
	e := newEnv(t, "dgx-h100")
	ctx := context.Background()
	old, next := e.start(), e.start() // the two instances of a rolling update
	if _, err := old.Prepare(ctx, claim("a", "gpu-0")); err != nil {
		t.Fatal(err)
	}
	writeJunk(t, e.dataDir)

	logger := ktesting.NewLogger(t, ktesting.NewConfig(ktesting.BufferLogs(true)))
	if err := next.Reload(klog.NewContext(ctx, logger)); err != nil {
		t.Fatalf("reload of a corrupted checkpoint: %v", err)
	}
	if logs := logger.GetSink().(ktesting.Underlier).GetBuffer().String(); !strings.Contains(logs, "Checkpoint is corrupted; rebuilding it") {
		t.Errorf("the rebuild is not logged; log:\n%s", logs)
	}
	if got := next.PreparedClaims(); len(got) != 1 || got["uid-a"].Devices[0].Device != "gpu-0" {
		t.Fatalf("claims after the rebuild: %+v, want default/a on gpu-0", got)
	}
	if _, err := next.Prepare(ctx, claim("thief", "gpu-0")); err == nil || !strings.Contains(err.Error(), "default/a") {
		t.Errorf("the rebuilt state lost ownership of gpu-0: %v", err)
	}
	moved, _ := filepath.Glob(filepath.Join(e.dataDir, checkpoint.FileName+".corrupt-*"))
	if len(moved) != 1 {
		t.Errorf("corrupted checkpoint not kept aside: %v", moved)
	}
	// The rebuilt checkpoint is on disk: the other instance reloads it.
	if err := old.Reload(ctx); err != nil {
		t.Fatalf("the other instance's reload after the rebuild: %v", err)
	}
	if err := old.Unprepare(ctx, "uid-a"); err != nil {
		t.Fatal(err)
	}
	if d := load(t, e.dataDir); len(d.Claims) != 0 || len(specFiles(t, e.cdiDir)) != 0 {
		t.Errorf("after unprepare: checkpoint %+v, specs %v", d.Claims, specFiles(t, e.cdiDir))
	}
}
