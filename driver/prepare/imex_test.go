package prepare_test

import (
	"context"
	"errors"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"

	resourceapi "k8s.io/api/resource/v1"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/devnodes"
	"github.com/tessera-dev/tessera/driver/domain"
	"github.com/tessera-dev/tessera/driver/prepare"
)

// fakeIMEX records the IMEX daemons the state machine starts and stops;
// failStart makes Start fail, as a daemon that never becomes ready does.
type fakeIMEX struct {
	mu        sync.Mutex
	started   []prepare.IMEXDaemon
	stopped   []string
	running   map[string]bool // by pod
	failStart error
	// off is a plugin without an IMEX image: it stops daemons, starts none.
	off bool
}

func (f *fakeIMEX) Runs() bool { return !f.off }

// Running lists the pods of the daemons started and not stopped since (a
// daemon that failed to become ready runs all the same).
func (f *fakeIMEX) Running() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Sorted(maps.Keys(f.running))
}

func (f *fakeIMEX) Locate(uid string) checkpoint.Daemon {
	return checkpoint.Daemon{Pod: "tessera-imex-" + uid, Dir: "/imex/" + uid}
}

func (f *fakeIMEX) Start(_ context.Context, d prepare.IMEXDaemon) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.started = append(f.started, d)
	if f.running == nil {
		f.running = map[string]bool{}
	}
	f.running[d.Pod] = true
	return f.failStart
}

func (f *fakeIMEX) Stop(_ context.Context, d checkpoint.Daemon) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.stopped = append(f.stopped, d.Pod)
	delete(f.running, d.Pod)
	return nil
}

// nvlinkClaim is a gang's domain claim on channel 0 of an NVLink clique,
// with the nodes the controller wrote (none when nodes is empty).
func nvlinkClaim(name, nodes string) *resourceapi.ResourceClaim {
	c := domainClaim(name)
	c.Status.Allocation.Devices.Results[0].Pool = domain.PoolName(domain.KindNVLink, "cluster-1.0")
	if nodes != "" {
		c.Annotations = map[string]string{gangv1.AnnotationNodes: nodes, gangv1.AnnotationPlacement: "p-1"}
	}
	return c
}

// nvlinkPreparer is the env's domain preparer, able to name IMEX channels.
func (e *env) nvlinkPreparer() *domain.Preparer {
	e.t.Helper()
	p := e.domainPreparer()
	dev, err := devnodes.New(e.node.DevRoot(), e.node.HostRoot)
	if err != nil {
		e.t.Fatal(err)
	}
	p.DevNodes = dev
	return p
}

// gangPrepared prepares a two-tray gang's domain claim (name) on a GB200
// tray whose plugin runs IMEX daemons.
func gangPrepared(t *testing.T, name string) (*env, *fakeIMEX, *prepare.Manager, *resourceapi.ResourceClaim) {
	t.Helper()
	e := newEnv(t, "gb200-nvl72-tray")
	imex := &fakeIMEX{}
	e.imex = imex
	m := e.start()
	c := nvlinkClaim(name, "tray-1=10.0.0.1,"+nodeName+"=10.0.0.2")
	if _, err := m.PrepareDomain(context.Background(), c, e.nvlinkPreparer().Prepare); err != nil {
		t.Fatal(err)
	}
	return e, imex, m, c
}

func TestAGangsNVLinkDomainClaimRunsItsIMEXDaemonUntilUnprepared(t *testing.T) {
	e, imex, m, c := gangPrepared(t, "gang")
	want := []gangv1.Node{{Name: "tray-1", Address: "10.0.0.1"}, {Name: nodeName, Address: "10.0.0.2"}}
	if len(imex.started) != 1 || !slices.Equal(imex.started[0].Nodes, want) || imex.started[0].Pod != "tessera-imex-"+string(c.UID) {
		t.Fatalf("daemons started: %+v, want one for %s with nodes %v", imex.started, c.UID, want)
	}
	rec := load(t, e.dataDir).Claims[string(c.UID)]
	if rec.Phase != checkpoint.PrepareCompleted || rec.IMEX == nil || rec.IMEX.Pod != imex.started[0].Pod {
		t.Fatalf("checkpoint records %+v, want a completed claim with its daemon", rec)
	}
	// A second prepare (the kubelet's retry) finds the daemon serving.
	if _, err := m.PrepareDomain(context.Background(), c, e.nvlinkPreparer().Prepare); err != nil {
		t.Fatal(err)
	}
	if err := m.Unprepare(context.Background(), c.UID); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(imex.stopped, []string{imex.started[0].Pod}) {
		t.Errorf("daemons stopped at unprepare: %v, want %s", imex.stopped, imex.started[0].Pod)
	}
	if _, ok := load(t, e.dataDir).Claims[string(c.UID)]; ok || e.domainSpecExists(c.UID) {
		t.Errorf("unprepare left the record (%v) or the spec (%v)", ok, e.domainSpecExists(c.UID))
	}
}

// TestTurningIMEXOffStopsTheDaemonsThatRanAndStartsNone: once the plugin
// restarts without IMEX daemons (no image), a new gang domain claim gets
// its channel and no daemon, and the claim prepared before still has its
// daemon stopped at unprepare.
func TestTurningIMEXOffStopsTheDaemonsThatRanAndStartsNone(t *testing.T) {
	e, imex, _, before := gangPrepared(t, "before")
	imex.off = true
	m := e.start()
	after := nvlinkClaim("after", "tray-1=10.0.0.1,"+nodeName+"=10.0.0.2")
	after.Status.Allocation.Devices.Results[0].Device = domain.DeviceName(1)
	if _, err := m.PrepareDomain(context.Background(), after, e.nvlinkPreparer().Prepare); err != nil {
		t.Fatal(err)
	}
	if len(imex.started) != 1 {
		t.Errorf("daemons started: %+v, want only the one from before IMEX was turned off", imex.started)
	}
	if rec := load(t, e.dataDir).Claims[string(after.UID)]; rec.IMEX != nil {
		t.Errorf("claim prepared with IMEX off recorded with a daemon: %+v", rec)
	}
	for _, c := range []*resourceapi.ResourceClaim{before, after} {
		if err := m.Unprepare(context.Background(), c.UID); err != nil {
			t.Fatalf("unprepare of %s with IMEX off: %v", c.Name, err)
		}
	}
	if want := []string{"tessera-imex-" + string(before.UID)}; !slices.Equal(imex.stopped, want) {
		t.Errorf("daemons stopped: %v, want %v", imex.stopped, want)
	}
}

// TestAnInstanceWithoutIMEXKeepsTheDaemonTheOtherRecorded: in a rolling
// update that turns IMEX daemons off, the old instance's prepare recorded
// the claim's daemon and failed to see it ready; the new instance, asked
// again, prepares the claim without a daemon of its own and keeps the
// recorded one in the claim's record, so that the unprepare stops it.
func TestAnInstanceWithoutIMEXKeepsTheDaemonTheOtherRecorded(t *testing.T) {
	e := newEnv(t, "gb200-nvl72-tray")
	e.rolling = true
	on := &fakeIMEX{failStart: errors.New("IMEX daemon pod tessera-system/x not ready after 30s")}
	e.imex = on
	old := e.start()
	off := &fakeIMEX{off: true}
	e.imex = off
	newer := e.start()
	c := nvlinkClaim("gang", "tray-1=10.0.0.1,"+nodeName+"=10.0.0.2")
	if _, err := old.PrepareDomain(context.Background(), c, e.nvlinkPreparer().Prepare); err == nil {
		t.Fatal("prepare through the old instance succeeded, want its daemon's failure")
	}
	if _, err := newer.PrepareDomain(context.Background(), c, e.nvlinkPreparer().Prepare); err != nil {
		t.Fatal(err)
	}
	rec := load(t, e.dataDir).Claims[string(c.UID)]
	if rec.Phase != checkpoint.PrepareCompleted || rec.IMEX == nil || rec.IMEX.Pod != "tessera-imex-"+string(c.UID) {
		t.Fatalf("record after the new instance's prepare: %+v, want completed with the old instance's daemon", rec)
	}
	if err := newer.Unprepare(context.Background(), c.UID); err != nil {
		t.Fatal(err)
	}
	if want := []string{"tessera-imex-" + string(c.UID)}; !slices.Equal(off.stopped, want) || len(off.started) != 0 {
		t.Errorf("the new instance started %v and stopped %v, want none started and %v stopped", off.started, off.stopped, want)
	}
}

func TestAnIMEXDaemonThatFailsFailsThePrepareAndARestartStopsIt(t *testing.T) {
	e := newEnv(t, "gb200-nvl72-tray")
	imex := &fakeIMEX{failStart: errors.New("IMEX daemon pod tessera-system/x not ready after 30s (last seen: CrashLoopBackOff)")}
	e.imex = imex
	m := e.start()
	c := nvlinkClaim("gang", nodeName+"=10.0.0.2")
	_, err := m.PrepareDomain(context.Background(), c, e.nvlinkPreparer().Prepare)
	if err == nil || !strings.Contains(err.Error(), "IMEX daemon") || !strings.Contains(err.Error(), "CrashLoopBackOff") {
		t.Fatalf("prepare with a failing daemon: %v, want an error naming the daemon and why", err)
	}
	rec := load(t, e.dataDir).Claims[string(c.UID)]
	if rec.Phase != checkpoint.PrepareStarted || rec.IMEX == nil {
		t.Fatalf("checkpoint records %+v, want the daemon recorded with a started mark", rec)
	}
	// The plugin restarts before the kubelet retries: the interrupted
	// prepare is rolled back, its daemon stopped, its spec removed.
	e.start()
	if !slices.Equal(imex.stopped, []string{"tessera-imex-" + string(c.UID)}) {
		t.Errorf("daemons stopped by the restart: %v, want the failed claim's", imex.stopped)
	}
	if _, ok := load(t, e.dataDir).Claims[string(c.UID)]; ok || e.domainSpecExists(c.UID) {
		t.Errorf("the restart left the record (%v) or the spec (%v)", ok, e.domainSpecExists(c.UID))
	}
}

func TestNoIMEXDaemonWithoutTheGangsNodesOrOnATopologyDomain(t *testing.T) {
	e := newEnv(t, "gb200-nvl72-tray")
	imex := &fakeIMEX{}
	e.imex = imex
	m := e.start()
	alone := nvlinkClaim("alone", "") // allocated by the scheduler, no gang
	rack := domainClaim("rack")
	rack.Annotations = map[string]string{gangv1.AnnotationNodes: nodeName + "=10.0.0.2", gangv1.AnnotationPlacement: "p-1"}
	for _, c := range []*resourceapi.ResourceClaim{alone, rack} {
		if _, err := m.PrepareDomain(context.Background(), c, e.nvlinkPreparer().Prepare); err != nil {
			t.Fatal(err)
		}
		if rec := load(t, e.dataDir).Claims[string(c.UID)]; rec.IMEX != nil {
			t.Errorf("claim %s recorded with a daemon: %+v", c.Name, rec)
		}
	}
	if len(imex.started) != 0 {
		t.Errorf("daemons started: %+v, want none", imex.started)
	}
}
