package prepare_test

import (
	"context"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"

	"github.com/tessera-dev/tessera/cdi"
	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/mig"
	"github.com/tessera-dev/tessera/driver/nodelock"
	"github.com/tessera-dev/tessera/driver/prepare"
)

// gatedMPS is fakeMPS whose daemons take until the test lets them serve.
type gatedMPS struct {
	*fakeMPS
	starting chan struct{} // closed when the first Start waits
	serve    chan struct{} // closed to let Starts return
	once     sync.Once
}

func (g *gatedMPS) Start(ctx context.Context, d prepare.MPSDaemon) (cdi.Edits, error) {
	g.once.Do(func() { close(g.starting) })
	<-g.serve
	return g.fakeMPS.Start(ctx, d)
}

// TestTheOtherInstanceGoesOnWhileADaemonStarts: in a rolling update, while
// one instance waits for a claim's MPS daemon, the other starts (its
// recovery leaves that claim alone: it is under way, not interrupted) and
// prepares and unprepares other claims; then the first completes, and both
// see the claim prepared.
func TestTheOtherInstanceGoesOnWhileADaemonStarts(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t, "dgx-h100")
	e.rolling = true
	mps := &gatedMPS{fakeMPS: &fakeMPS{dir: t.TempDir()}, starting: make(chan struct{}), serve: make(chan struct{})}
	e.mps = mps
	defer func() {
		select {
		case <-mps.serve:
		default:
			close(mps.serve)
		}
	}()
	old, err := prepare.New(ctx, e.config())
	if err != nil {
		t.Fatal(err)
	}
	slow := gpuConfig(claim("inference", "gpu-3"), `"sharing":{"strategy":"MPS"}`)
	slowErr := make(chan error, 1)
	go func() {
		_, err := old.Prepare(ctx, slow)
		slowErr <- err
	}()
	<-mps.starting

	newer, err := prepare.New(ctx, e.config())
	if err != nil {
		t.Fatal(err)
	}
	got, err := newer.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if c, ok := got[slow.UID]; !ok || c.Phase != checkpoint.PrepareStarted {
		t.Fatalf("the new instance's start settled a claim under way in the old one: %+v (present %v)", c, ok)
	}
	if mps.stopped != nil {
		t.Fatalf("the new instance's start stopped daemons %v", mps.stopped)
	}
	other := claim("other", "gpu-4")
	if _, err := newer.Prepare(ctx, other); err != nil {
		t.Fatalf("prepare while another claim's daemon starts: %v", err)
	}
	if _, err := newer.Prepare(ctx, claim("intruder", "gpu-3")); err == nil {
		t.Fatal("the new instance handed out gpu-3, which the old one is preparing")
	}
	if err := old.Unprepare(ctx, other.UID); err != nil {
		t.Fatalf("unprepare while another claim's daemon starts: %v", err)
	}

	close(mps.serve)
	if err := <-slowErr; err != nil {
		t.Fatalf("the claim whose daemon was awaited: %v", err)
	}
	for name, m := range map[string]*prepare.Manager{"old": old, "new": newer} {
		got, err := m.Snapshot(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if c := got[slow.UID]; c.Phase != checkpoint.PrepareCompleted || len(got) != 1 {
			t.Errorf("the %s instance sees %+v, want only %s prepared", name, got, slow.Name)
		}
	}
	if err := newer.Unprepare(ctx, slow.UID); err != nil {
		t.Fatal(err)
	}
	if r := mps.Running(); len(r) != 0 {
		t.Errorf("daemons left running: %v", r)
	}
}

// TestTheDaemonSweepStopsOnlyDaemonsOfClaimsNotHeld: the sweep lists
// daemons outside every lock; the state machine stops one only if, under
// its claim's lock, no prepared claim holds it.
func TestTheDaemonSweepStopsOnlyDaemonsOfClaimsNotHeld(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t, "dgx-h100")
	mps := &fakeMPS{dir: t.TempDir()}
	e.mps = mps
	m := e.start()
	kept := gpuConfig(claim("kept", "gpu-3"), `"sharing":{"strategy":"MPS"}`)
	if _, err := m.Prepare(ctx, kept); err != nil {
		t.Fatal(err)
	}
	if _, err := mps.Start(ctx, prepare.MPSDaemon{MPSDaemon: mps.Locate("uid-gone"), ClaimUID: "uid-gone"}); err != nil {
		t.Fatal(err)
	}
	for uid, want := range map[string]bool{"uid-kept": false, "uid-gone": true} {
		if stopped, err := m.StopOrphanDaemon(ctx, uid); err != nil || stopped != want {
			t.Errorf("StopOrphanDaemon(%s) = %v, %v; want %v", uid, stopped, err, want)
		}
	}
	if r := mps.Running(); !slices.Equal(r, []string{"tessera-mps-uid-kept"}) {
		t.Errorf("daemons running %v, want only the prepared claim's", r)
	}
}

// TestTheStaleSweepUnpreparesOnlyAClaimAsItSawIt: the stale-claim sweep
// asks the API server outside every lock; a claim whose record changed
// meanwhile is left for the next sweep.
func TestTheStaleSweepUnpreparesOnlyAClaimAsItSawIt(t *testing.T) {
	ctx := context.Background()
	m := newEnv(t, "pcie-l4x4").start()
	c := claim("x", "gpu-1")
	if _, err := m.Prepare(ctx, c); err != nil {
		t.Fatal(err)
	}
	seen := m.PreparedClaims()[c.UID]
	// Meanwhile the claim was unprepared and prepared again elsewhere.
	if err := m.Unprepare(ctx, c.UID); err != nil {
		t.Fatal(err)
	}
	if _, err := m.Prepare(ctx, claim("x", "gpu-2")); err != nil {
		t.Fatal(err)
	}
	if done, err := m.UnprepareStale(ctx, c.UID, seen); done || err != nil {
		t.Fatalf("a claim changed since the sweep read it was unprepared (%v, %v)", done, err)
	}
	if _, ok := m.PreparedClaims()[c.UID]; !ok {
		t.Fatal("the changed claim is gone")
	}
	if done, err := m.UnprepareStale(ctx, c.UID, m.PreparedClaims()[c.UID]); !done || err != nil {
		t.Fatalf("the claim as seen was not unprepared (%v, %v)", done, err)
	}
}

// newGatedRollingEnv is a rolling update's DGX H100 whose MPS daemons start
// when the test lets them.
func newGatedRollingEnv(t *testing.T) (*env, *gatedMPS) {
	e := newEnv(t, "dgx-h100")
	e.rolling = true
	mps := &gatedMPS{fakeMPS: &fakeMPS{dir: t.TempDir()}, starting: make(chan struct{}), serve: make(chan struct{})}
	e.mps = mps
	return e, mps
}

// startGatedPrepare runs m.Prepare(c) until its MPS daemon's start waits,
// and returns what the prepare returns once the gate opens.
func startGatedPrepare(t *testing.T, m *prepare.Manager, mps *gatedMPS, c *resourceapi.ResourceClaim) <-chan error {
	t.Helper()
	errc := make(chan error, 1)
	go func() {
		_, err := m.Prepare(context.Background(), c)
		errc <- err
	}()
	select {
	case <-mps.starting:
	case err := <-errc:
		t.Fatalf("the prepare returned before its daemon started: %v", err)
	}
	return errc
}

// TestAPrepareAnEarlierReleaseRolledBackMeanwhileIsNotMarkedCompleted: in a
// rolling update from an earlier release, whose instance knows no claim
// locks and rolls back every started claim when it (re)starts, that rollback
// lands while this instance is preparing the claim (its partition made, its
// daemon starting). The prepare fails, for the kubelet to retry, and leaves
// nothing: no record of a claim whose partition is gone, no partition, spec
// or daemon.
func TestAPrepareAnEarlierReleaseRolledBackMeanwhileIsNotMarkedCompleted(t *testing.T) {
	ctx := context.Background()
	e, mps := newGatedRollingEnv(t)
	m := e.start()
	c := withConfig(claim("train", "gpu-2-mig-1g10gb-6"), driverName, `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"MigDeviceConfig","sharing":{"strategy":"MPS"}}`)
	errc := startGatedPrepare(t, m, mps, c)

	// The earlier release's start: under the node lock, every started
	// claim rolled back from its record.
	unlock, err := nodelock.New(e.dataDir).LockNode()
	if err != nil {
		t.Fatal(err)
	}
	ck, err := checkpoint.NewStore(e.dataDir)
	if err != nil {
		t.Fatal(err)
	}
	data, err := ck.Load()
	if err != nil {
		t.Fatal(err)
	}
	rec, ok := data.Claims[string(c.UID)]
	if !ok || rec.Phase != checkpoint.PrepareStarted || rec.Devices[0].MIG == nil || rec.Devices[0].MIG.UUID == "" {
		t.Fatalf("the claim's started record before the rollback: %+v (present %v)", rec, ok)
	}
	p := rec.Devices[0].MIG
	if _, err := e.mig.Destroy(p.GPUUUID, p.Switchable, p.ProfileIndex, mig.Placement{Start: p.Start, Size: p.Size}, p.UUID); err != nil {
		t.Fatal(err)
	}
	if err := mps.Stop(ctx, *rec.MPS); err != nil {
		t.Fatal(err)
	}
	delete(data.Claims, string(c.UID))
	if err := ck.Save(data); err != nil {
		t.Fatal(err)
	}
	unlock()

	close(mps.serve)
	if err := <-errc; err == nil {
		t.Error("the prepare rolled back meanwhile succeeded")
	}
	got, err := m.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if c, ok := got[c.UID]; ok {
		t.Errorf("the rolled-back claim is recorded: %+v", c)
	}
	if n := e.node.GPUInstances(2); n != 0 {
		t.Errorf("GPU 2 has %d MIG instances, want none", n)
	}
	if f := specFiles(t, e.cdiDir); len(f) != 0 {
		t.Errorf("CDI specs left: %v", f)
	}
	if r := mps.Running(); len(r) != 0 {
		t.Errorf("daemons left running: %v", r)
	}
	// The kubelet's retry prepares it.
	if _, err := m.Prepare(ctx, c); err != nil {
		t.Fatalf("the retry: %v", err)
	}
}

// TestAPrepareARebuildLostMeanwhileDoesNotShareItsGPU: in a rolling update,
// the other instance finds the checkpoint corrupted while this one prepares
// a claim and rebuilds it from the CDI specs, which do not know the claim
// yet (its spec comes last); the other instance then prepares another claim
// on the same GPU. The first prepare fails rather than record a GPU two
// claims hold, and undoes what it made.
func TestAPrepareARebuildLostMeanwhileDoesNotShareItsGPU(t *testing.T) {
	ctx := context.Background()
	e, mps := newGatedRollingEnv(t)
	m := e.start()
	first := gpuConfig(claim("first", "gpu-3"), `"sharing":{"strategy":"MPS"}`)
	errc := startGatedPrepare(t, m, mps, first)

	ck, err := checkpoint.NewStore(e.dataDir)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(ck.Path(), []byte("{not a checkpoint"), 0o600); err != nil {
		t.Fatal(err)
	}
	other := e.start()
	if _, err := other.Prepare(ctx, claim("second", "gpu-3")); err != nil {
		t.Fatalf("the other instance's prepare after the rebuild: %v", err)
	}

	close(mps.serve)
	if err := <-errc; err == nil {
		t.Error("the prepare the rebuild lost succeeded")
	}
	got, err := m.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var holders []string
	for _, c := range got {
		for _, d := range c.Devices {
			if d.Device == "gpu-3" {
				holders = append(holders, c.Name)
			}
		}
	}
	if !slices.Equal(holders, []string{"second"}) {
		t.Errorf("gpu-3 held by %v, want only the claim prepared after the rebuild", holders)
	}
	if r := mps.Running(); len(r) != 0 {
		t.Errorf("daemons left running: %v", r)
	}
}

// TestConcurrentSectionsShareTheNodeLockAndOneWrite: in a rolling update,
// the sections of concurrent claims waiting for the node lock (here four
// unprepares of whole GPUs, one checkpoint change each, while the other
// instance holds the lock) run as a batch: at most two checkpoint writes
// (the first caller's batch and the rest's), not one each.
func TestConcurrentSectionsShareTheNodeLockAndOneWrite(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t, "dgx-h100")
	e.rolling = true
	cfg := e.config()
	var writes atomic.Int32
	cfg.Checkpoint.OnWrite = func(time.Duration) { writes.Add(1) }
	m, err := prepare.New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	var claims []*resourceapi.ResourceClaim
	for _, d := range []string{"gpu-0", "gpu-1", "gpu-2", "gpu-3"} {
		c := claim("c-"+d, d)
		if _, err := m.Prepare(ctx, c); err != nil {
			t.Fatal(err)
		}
		claims = append(claims, c)
	}

	unlock, err := nodelock.New(e.dataDir).LockNode() // the other instance
	if err != nil {
		t.Fatal(err)
	}
	errs := make(chan error, len(claims))
	for _, c := range claims {
		go func() { errs <- m.Unprepare(ctx, c.UID) }()
	}
	deadline := time.Now().Add(30 * time.Second)
	for m.SectionsUnderWay() < len(claims) {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d unprepares reached the node lock", m.SectionsUnderWay(), len(claims))
		}
		time.Sleep(time.Millisecond)
	}
	writes.Store(0)
	unlock()
	for range claims {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if n := writes.Load(); n > 2 {
		t.Errorf("%d concurrent unprepares wrote the checkpoint %d times, want at most 2", len(claims), n)
	}
	if got, err := m.Snapshot(ctx); err != nil || len(got) != 0 {
		t.Errorf("claims left: %v (%v)", got, err)
	}
}
