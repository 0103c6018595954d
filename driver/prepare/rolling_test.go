package prepare_test

import (
	"context"
	"slices"
	"sync"
	"testing"

	"github.com/tessera-dev/tessera/cdi"
	"github.com/tessera-dev/tessera/driver/checkpoint"
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
