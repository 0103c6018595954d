//go:build faultinject

package prepare_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/google/go-cmp/cmp"

	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/prepare"
)

// A checkpoint write that fails (a full or failing disk) fails the prepare,
// and the kubelet retries it: through the same process, through the other
// instance of a rolling update (which starts every call from the checkpoint
// on disk), or after a restart. Whichever write failed (the started mark, a
// GPU setting's original, the completed mark), the retry prepares the claim
// exactly once, every step taken again idempotently: the partition the
// failed attempt made is adopted, not found occupied; the spec rewritten;
// the setting found applied; the daemon found running. Shares the crash
// tests' claim kinds and checks; each kind's prepare makes exactly the
// number of writes its table entry says: every one of them failing fails
// the prepare, and a prepare whose first write past the last would fail
// succeeds, having made no more.
func TestAPrepareRetriedAfterAFailedCheckpointWriteSucceeds(t *testing.T) {
	for _, k := range crashClaims {
		t.Run(fmt.Sprintf("a %s claim makes %d writes", k.name, k.writes), func(t *testing.T) {
			e := newCrashEnv(t)
			m, heal := e.startFailingWrite(k.writes + 1)
			c := k.claim("crash")
			_, err := e.prepareClaim(context.Background(), m, c)
			heal()
			if err != nil {
				t.Fatalf("prepare with write %d failing: %v; want success after %d writes", k.writes+1, err, k.writes)
			}
			assertPrepared(t, e, m, c, k.kind)
		})
		for n := 1; n <= k.writes; n++ {
			for _, retry := range []string{"the same process", "a rolling update's other instance", "a restart"} {
				t.Run(fmt.Sprintf("write %d of a %s claim failing, retried by %s", n, k.name, retry), func(t *testing.T) {
					e := newCrashEnv(t)
					ctx := context.Background()
					c := k.claim("crash")
					other := e.start()
					m, heal := e.startFailingWrite(n)

					_, err := e.prepareClaim(ctx, m, c)
					heal()
					if err == nil {
						t.Fatalf("the prepare succeeded with write %d of its %d failing", n, k.writes)
					}
					t.Logf("prepare with write %d failing: %v", n, err)
					left := instances(t, e)

					switch retry {
					case "a rolling update's other instance":
						if err := other.Reload(ctx); err != nil {
							t.Fatal(err)
						}
						m = other
					case "a restart":
						m = e.start()
					}
					devs, err := e.prepareClaim(ctx, m, c)
					if err != nil {
						t.Fatalf("retried prepare: %v", err)
					}
					ids := assertPrepared(t, e, m, c, k.kind)
					if len(devs) != 1 || !slices.Equal(devs[0].CDIDeviceIDs, ids) {
						t.Errorf("retried prepare returned %+v, want the recorded CDI IDs %v", devs, ids)
					}
					if retry != "a restart" && len(left) != 0 {
						if diff := cmp.Diff(left, instances(t, e)); diff != "" {
							t.Errorf("the failed attempt's partition was not adopted (-left +now):\n%s", diff)
						}
					}
					// What is on disk holds: a restart keeps the claim.
					assertPrepared(t, e, e.start(), c, k.kind)
					if err := m.Unprepare(ctx, c.UID); err != nil {
						t.Fatalf("unprepare: %v", err)
					}
					assertUnprepared(t, e, m, c)
				})
			}
		}
	}
}

// startFailingWrite starts a Manager whose n-th checkpoint write from now
// fails, as a broken disk fails it (the directory is gone), until heal puts
// the directory back with the last file written in it.
func (e *env) startFailingWrite(n int) (m *prepare.Manager, heal func()) {
	e.t.Helper()
	gone := e.dataDir + ".gone"
	return e.startBreakingAtWrite(n, func() error { return os.Rename(e.dataDir, gone) },
		func() error { return os.Rename(gone, e.dataDir) })
}

// startFailingCheckpointWrite is startFailingWrite for the checkpoint alone:
// its n-th write from now fails (a directory stands where the file is
// renamed to) while the rest of the data directory (the host device nodes'
// records) stays writable; heal puts the last file written back.
func (e *env) startFailingCheckpointWrite(n int) (m *prepare.Manager, heal func()) {
	e.t.Helper()
	path := filepath.Join(e.dataDir, checkpoint.FileName)
	kept := path + ".kept"
	return e.startBreakingAtWrite(n,
		func() error {
			if err := os.Rename(path, kept); err != nil {
				return err
			}
			return os.MkdirAll(filepath.Join(path, "in-the-way"), 0o755)
		},
		func() error {
			if err := os.RemoveAll(path); err != nil {
				return err
			}
			return os.Rename(kept, path)
		})
}

// startBreakingAtWrite starts a Manager and runs brk just before its n-th
// checkpoint write from now (after the one before it); heal runs mend if
// brk ran.
func (e *env) startBreakingAtWrite(n int, brk, mend func() error) (m *prepare.Manager, heal func()) {
	e.t.Helper()
	var broken atomic.Bool
	doBreak := func() {
		if err := brk(); err != nil {
			e.t.Fatal(err)
		}
		broken.Store(true)
	}
	cfg := e.config()
	var writes atomic.Int32
	counting := false
	cfg.Checkpoint.OnWrite = func(time.Duration) {
		if counting && int(writes.Add(1)) == n-1 {
			doBreak()
		}
	}
	m, err := prepare.New(context.Background(), cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	counting = true
	if n == 1 {
		doBreak()
	}
	return m, func() {
		if broken.Load() {
			if err := mend(); err != nil {
				e.t.Fatal(err)
			}
		}
	}
}

// An attempt that died inside the partition's creation (its GPU instance
// made, not its compute instance) leaves an instance no workload can use;
// the retry by a rolling update's other instance, from the started mark,
// replaces it rather than finding its placement occupied.
func TestARetryReplacesAPartitionLeftWithoutItsComputeInstance(t *testing.T) {
	e := newCrashEnv(t)
	ctx := context.Background()
	c := claim("crash", part)
	other := e.start()
	if _, err := e.start().Prepare(ctx, c); err != nil {
		t.Fatal(err)
	}
	// The started mark, as written before the partition was created.
	e.rewindToStarted(c)
	data := load(t, e.dataDir)
	rec := data.Claims[string(c.UID)]
	rec.Devices[0].MIG.GPUInstance, rec.Devices[0].MIG.ComputeInstance, rec.Devices[0].MIG.UUID = 0, 0, ""
	data.Claims[string(c.UID)] = rec
	save(t, e.dataDir, data)
	d, ret := e.node.NVML.DeviceGetHandleByUUID(e.gpus[0].UUID)
	if ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	p, ret := d.GetGpuInstanceProfileInfo(0) // 1g.10gb, the partition's profile
	if ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	gis, ret := d.GetGpuInstances(&p)
	if ret != nvml.SUCCESS || len(gis) != 1 {
		t.Fatalf("GPU instances %v: %v", gis, ret)
	}
	for id := range nvml.COMPUTE_INSTANCE_PROFILE_COUNT {
		cp, ret := gis[0].GetComputeInstanceProfileInfo(id, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
		if ret != nvml.SUCCESS {
			continue
		}
		cis, _ := gis[0].GetComputeInstances(&cp)
		for _, ci := range cis {
			if ret := ci.Destroy(); ret != nvml.SUCCESS {
				t.Fatal(ret)
			}
		}
	}
	if insts := instances(t, e); len(insts) != 1 || insts[0].UUID != "" {
		t.Fatalf("instances %+v, want one without a compute instance", insts)
	}

	if err := other.Reload(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := other.Prepare(ctx, c); err != nil {
		t.Fatalf("retried prepare: %v", err)
	}
	assertPrepared(t, e, other, c, partition)
	if err := other.Unprepare(ctx, c.UID); err != nil {
		t.Fatal(err)
	}
	assertUnprepared(t, e, other, c)
}

// TestAFailedStartedMarkOnARetryKeepsTheEarlierAttemptsRecord: a prepare
// whose completed mark failed leaves its started record, with the partition
// it made; the retry's own started mark failing too must leave that record
// as it is, in memory as on disk, or the partition would be recorded
// nowhere: every later attempt would find its placement occupied, and no
// unprepare would destroy it.
func TestAFailedStartedMarkOnARetryKeepsTheEarlierAttemptsRecord(t *testing.T) {
	e := newCrashEnv(t)
	ctx := context.Background()
	c := crashClaim("crash", part, "")
	// Writes: the started mark, the partition's UUID, the completed mark.
	m, heal := e.startFailingCheckpointWrite(3)
	if _, err := m.Prepare(ctx, c); err == nil {
		t.Fatal("the prepare succeeded with its completed mark failing")
	}
	heal()
	made := instances(t, e)
	if len(made) != 1 {
		t.Fatalf("the failed attempt left %d partitions, want its one", len(made))
	}

	gone := e.dataDir + ".gone"
	if err := os.Rename(e.dataDir, gone); err != nil {
		t.Fatal(err)
	}
	_, err := m.Prepare(ctx, c)
	if err := os.Rename(gone, e.dataDir); err != nil {
		t.Fatal(err)
	}
	if err == nil {
		t.Fatal("the retry succeeded with its started mark failing")
	}

	devs, err := m.Prepare(ctx, c)
	if err != nil {
		t.Fatalf("the next retry: %v", err)
	}
	if diff := cmp.Diff(made, instances(t, e)); diff != "" {
		t.Errorf("the first attempt's partition was not adopted (-made +now):\n%s", diff)
	}
	ids := assertPrepared(t, e, m, c, partition)
	if len(devs) != 1 || !slices.Equal(devs[0].CDIDeviceIDs, ids) {
		t.Errorf("the retry returned %+v, want the recorded CDI IDs %v", devs, ids)
	}
	if err := m.Unprepare(ctx, c.UID); err != nil {
		t.Fatal(err)
	}
	assertUnprepared(t, e, m, c)
}

// TestAPrepareOfAClaimAllocatedAgainUndoesTheEarlierAttempt: an attempt
// whose completed mark failed leaves its started record and partition; the
// claim is then allocated other devices (a gang rolled back and placed
// again). Its prepare destroys the earlier attempt's partition, from that
// record, before preparing the new device, instead of dropping the record
// and leaving the partition behind.
func TestAPrepareOfAClaimAllocatedAgainUndoesTheEarlierAttempt(t *testing.T) {
	e := newCrashEnv(t)
	ctx := context.Background()
	m, heal := e.startFailingCheckpointWrite(3)
	if _, err := m.Prepare(ctx, crashClaim("crash", part, "")); err == nil {
		t.Fatal("the prepare succeeded with its completed mark failing")
	}
	heal()
	if n := e.node.GPUInstances(0); n != 1 {
		t.Fatalf("the failed attempt left %d partitions on GPU 0, want its one", n)
	}
	again := crashClaim("crash", "gpu-1-mig-1g10gb-6", "")
	if _, err := m.Prepare(ctx, again); err != nil {
		t.Fatalf("the prepare of the claim allocated again: %v", err)
	}
	if n := e.node.GPUInstances(0); n != 0 {
		t.Errorf("GPU 0 keeps %d partitions of the earlier attempt, want none", n)
	}
	if n := e.node.GPUInstances(1); n != 1 {
		t.Errorf("GPU 1 has %d partitions, want the claim's one", n)
	}
	if err := m.Unprepare(ctx, again.UID); err != nil {
		t.Fatal(err)
	}
	if n := e.node.GPUInstances(1); n != 0 {
		t.Errorf("GPU 1 keeps %d partitions after the unprepare", n)
	}
}
