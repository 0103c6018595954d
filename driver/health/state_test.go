package health_test

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"k8s.io/klog/v2/ktesting"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/tessera-dev/tessera/driver/discovery"
	"github.com/tessera-dev/tessera/driver/fakenode"
	"github.com/tessera-dev/tessera/driver/health"
)

// restarts runs monitors one after another over one fake node, one fake
// clock and one state file, as plugin restarts do.
type restarts struct {
	t     *testing.T
	ctx   context.Context
	node  *fakenode.Node
	gpus  []discovery.GPU
	clock *testingclock.FakeClock
	path  string
	stop  func()
	mon   *health.Monitor
}

func newRestarts(t *testing.T) *restarts {
	t.Helper()
	_, ctx := ktesting.NewTestContext(t)
	n, err := fakenode.New("pcie-l4x4", fakenode.Options{Dir: t.TempDir(), NodeName: "node-a"})
	if err != nil {
		t.Fatal(err)
	}
	gpus, err := discovery.Discover(ctx, &n.Node)
	if err != nil {
		t.Fatal(err)
	}
	r := &restarts{t: t, ctx: ctx, node: n, gpus: gpus, clock: testingclock.NewFakeClock(start), path: filepath.Join(t.TempDir(), "health.json")}
	t.Cleanup(func() {
		if r.stop != nil {
			r.stop()
		}
	})
	return r
}

// start stops the running monitor, if any, and starts a new one.
func (r *restarts) start() *health.Monitor {
	r.t.Helper()
	if r.stop != nil {
		r.stop()
	}
	mon, err := health.New(r.node.NVML, r.gpus, health.Options{
		QuietPeriod: quiet, ProbeInterval: time.Second, WaitTimeout: 10 * time.Millisecond,
		Clock: r.clock, StatePath: r.path,
	})
	if err != nil {
		r.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(r.ctx)
	mon.Start(ctx)
	r.mon = mon
	r.stop = func() { cancel(); <-mon.Done(); r.stop = nil }
	return mon
}

// awaitState polls the monitor's state until ok holds (10 s bound).
func (r *restarts) awaitState(what string, ok func(health.Snapshot) bool) health.Snapshot {
	r.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		s := r.mon.State()
		if ok(s) {
			return s
		}
		if time.Now().After(deadline) {
			r.t.Fatalf("%s: not seen; state now %+v", what, s)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (r *restarts) probedAfter(at time.Time) {
	r.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for r.mon.LastProbe().Before(at) {
		if time.Now().After(deadline) {
			r.t.Fatalf("no probe at %s", at)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestFaultTaintSurvivesARestartUntilTheQuietPeriodEnds(t *testing.T) {
	r := newRestarts(t)
	r.start()
	if err := r.node.InjectXID(1, 48); err != nil {
		t.Fatal(err)
	}
	r.awaitState("gpu-1 tainted", func(s health.Snapshot) bool { return s[1].Status == health.Unhealthy })
	r.clock.Step(quiet / 2)

	// The GPU answers probes: only the saved state can keep it tainted.
	s := r.start().State()
	if diff := cmp.Diff([]string{"gpu.tessera.dev/xid=48:NoSchedule"}, taintsOf(s[1])); diff != "" {
		t.Fatalf("gpu-1 taints after restart (-want +got):\n%s", diff)
	}
	if s[1].Status != health.Unhealthy {
		t.Errorf("gpu-1 status after restart %s, want Unhealthy", s[1].Status)
	}
	if got := s[1].Taints[0].TimeAdded.Time; !got.Equal(start) {
		t.Errorf("restored TimeAdded %s, want the fault's time %s", got, start)
	}
	for _, i := range []int{0, 2, 3} {
		if s[i].Status != health.Healthy {
			t.Errorf("%s is %s after restart", s[i].Name, s[i].Status)
		}
	}

	// The quiet period runs from the fault before the restart, not from it.
	r.clock.Step(quiet/2 - time.Second)
	r.probedAfter(r.clock.Now())
	if s := r.mon.State(); s[1].Status != health.Unhealthy {
		t.Fatal("restored taint lifted before the quiet period ended")
	}
	r.clock.Step(time.Second)
	r.awaitState("gpu-1 healthy", func(s health.Snapshot) bool { return s[1].Status == health.Healthy && len(s[1].Taints) == 0 })

	// Lifted is saved too: the next restart starts healthy.
	if s := r.start().State(); s[1].Status != health.Healthy {
		t.Errorf("gpu-1 after a second restart: %s %v", s[1].Status, taintsOf(s[1]))
	}
}

func TestUnreadableHealthStateIsIgnored(t *testing.T) {
	for _, tc := range []struct{ name, content string }{
		{"corrupted", `{"version":1,"gpus":{"GPU-`},
		{"unknown version", `{"version":99,"gpus":{}}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRestarts(t)
			if err := os.WriteFile(r.path, []byte(tc.content), 0o600); err != nil {
				t.Fatal(err)
			}
			s := r.start().State()
			for _, d := range s {
				if d.Status != health.Healthy {
					t.Errorf("%s is %s: %v", d.Name, d.Status, taintsOf(d))
				}
			}
			// The next change replaces the bad file with a readable one.
			if err := r.node.InjectXID(2, 79); err != nil {
				t.Fatal(err)
			}
			r.awaitState("gpu-2 tainted", func(s health.Snapshot) bool { return s[2].Status == health.Unhealthy })
			if s := r.start().State(); s[2].Status != health.Unhealthy {
				t.Errorf("gpu-2 after restart: %s %v", s[2].Status, taintsOf(s[2]))
			}
		})
	}
}

func TestSavedStateOfAnUnknownGPUIsDropped(t *testing.T) {
	r := newRestarts(t)
	saved := `{"version":1,"gpus":{
		"GPU-not-on-this-node": {"taints":[{"key":"gpu.tessera.dev/xid","value":"48","effect":"NoSchedule","timeAdded":"2026-03-01T11:00:00Z"}],"lastFault":"2026-03-01T11:59:59Z"},
		"` + r.gpus[3].UUID + `": {"taints":[{"key":"gpu.tessera.dev/ecc","value":"double-bit","effect":"NoSchedule","timeAdded":"2026-03-01T11:00:00Z"},
			{"key":"gpu.tessera.dev/unmonitored","value":"not-supported","effect":"None"}],"lastFault":"2026-03-01T11:59:59Z"}}}`
	if err := os.WriteFile(r.path, []byte(saved), 0o600); err != nil {
		t.Fatal(err)
	}
	s := r.start().State()
	if len(s) != 4 {
		t.Fatalf("%d GPUs, want 4", len(s))
	}
	// The unmonitored mark is re-derived, not restored: gpu-3's events are watched.
	if diff := cmp.Diff([]string{"gpu.tessera.dev/ecc=double-bit:NoSchedule"}, taintsOf(s[3])); diff != "" {
		t.Errorf("gpu-3 taints (-want +got):\n%s", diff)
	}
	for _, i := range []int{0, 1, 2} {
		if len(s[i].Taints) > 0 {
			t.Errorf("%s got the unknown GPU's taints: %v", s[i].Name, taintsOf(s[i]))
		}
	}
	// Written again without the unknown GPU once the state changes.
	if err := r.node.InjectXID(0, 48); err != nil {
		t.Fatal(err)
	}
	r.awaitState("gpu-0 tainted", func(s health.Snapshot) bool { return s[0].Status == health.Unhealthy })
	raw, err := os.ReadFile(r.path)
	if err != nil {
		t.Fatal(err)
	}
	var f struct{ GPUs map[string]json.RawMessage }
	if err := json.Unmarshal(raw, &f); err != nil {
		t.Fatal(err)
	}
	var got []string
	for uuid := range f.GPUs {
		got = append(got, uuid)
	}
	if len(got) != 2 || strings.Contains(string(raw), "GPU-not-on-this-node") {
		t.Errorf("saved GPUs %v, want gpu-0's and gpu-3's only", got)
	}
}

func TestHealthStateIsWrittenOnlyWhenItChanges(t *testing.T) {
	r := newRestarts(t)
	r.start()
	r.clock.Step(time.Second)
	r.probedAfter(r.clock.Now())
	if _, err := os.Stat(r.path); !os.IsNotExist(err) {
		t.Fatalf("state file written while every GPU is healthy: %v", err)
	}
	if err := r.node.InjectXID(0, 48); err != nil {
		t.Fatal(err)
	}
	r.awaitState("gpu-0 tainted", func(s health.Snapshot) bool { return s[0].Status == health.Unhealthy })
	before, err := os.Stat(r.path)
	if err != nil {
		t.Fatal(err)
	}
	if before.Mode().Perm() != 0o600 {
		t.Errorf("state file mode %v, want 0600", before.Mode().Perm())
	}
	for range 3 {
		r.clock.Step(time.Second)
		r.probedAfter(r.clock.Now())
	}
	after, err := os.Stat(r.path)
	if err != nil {
		t.Fatal(err)
	}
	// Every write renames a new file into place.
	if !os.SameFile(before, after) {
		t.Error("state file rewritten though nothing changed")
	}
}
