package health_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"k8s.io/klog/v2/ktesting"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/tessera-dev/tessera/driver/discovery"
	"github.com/tessera-dev/tessera/driver/fakenode"
	"github.com/tessera-dev/tessera/driver/health"
)

var start = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

const quiet = time.Minute

type fixture struct {
	t       *testing.T
	ctx     context.Context
	node    *fakenode.Node
	clock   *testingclock.FakeClock
	mon     *health.Monitor
	metrics *health.Metrics
	changes <-chan health.Snapshot
}

// newFixture builds a fake node; prepare may fault it before the monitor starts.
func newFixture(t *testing.T, profile string, prepare func(*fakenode.Node)) *fixture {
	t.Helper()
	_, ctx := ktesting.NewTestContext(t)
	ctx, cancel := context.WithCancel(ctx)
	n, err := fakenode.New(profile, fakenode.Options{Dir: t.TempDir(), NodeName: "node-a"})
	if err != nil {
		t.Fatal(err)
	}
	gpus, err := discovery.Discover(ctx, &n.Node)
	if err != nil {
		t.Fatal(err)
	}
	if prepare != nil {
		prepare(n)
	}
	f := &fixture{t: t, ctx: ctx, node: n, clock: testingclock.NewFakeClock(start)}
	if f.metrics, err = health.NewMetrics(prometheus.NewRegistry()); err != nil {
		t.Fatal(err)
	}
	f.mon, err = health.New(n.NVML, gpus, health.Options{
		QuietPeriod: quiet, ProbeInterval: time.Second, WaitTimeout: 10 * time.Millisecond,
		Clock: f.clock, Metrics: f.metrics,
	})
	if err != nil {
		t.Fatal(err)
	}
	f.mon.Start(ctx)
	t.Cleanup(func() { cancel(); <-f.mon.Done() })
	var unsubscribe func()
	f.changes, unsubscribe = f.mon.Subscribe()
	t.Cleanup(unsubscribe)
	return f
}

// await returns the first published state that satisfies ok, failing after a
// generous real-time bound.
func (f *fixture) await(what string, ok func(health.Snapshot) bool) health.Snapshot {
	f.t.Helper()
	deadline := time.After(10 * time.Second)
	var last health.Snapshot
	for {
		select {
		case last = <-f.changes:
			if ok(last) {
				return last
			}
		case <-deadline:
			f.t.Fatalf("%s: not seen; last state %+v", what, last)
		}
	}
}

// probedAfter waits until the monitor has probed at or after the fake time.
func (f *fixture) probedAfter(at time.Time) {
	f.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for f.mon.LastProbe().Before(at) {
		if time.Now().After(deadline) {
			f.t.Fatalf("no probe at %s", at)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func taintsOf(d health.DeviceState) []string {
	var out []string
	for _, t := range d.Taints {
		out = append(out, t.Key+"="+t.Value+":"+string(t.Effect))
	}
	return out
}

func tainted(i int) func(health.Snapshot) bool {
	return func(s health.Snapshot) bool { return len(s[i].Taints) > 0 }
}

func TestInjectedFaultsTaintTheGPUWithinASecond(t *testing.T) {
	for _, tc := range []struct {
		name   string
		inject func(*fakenode.Node) error
		want   []string
		status health.Status
	}{
		{"XID 79 fallen off the bus", func(n *fakenode.Node) error { return n.InjectXID(2, 79) }, []string{"gpu.tessera.dev/xid=79:NoSchedule"}, health.Unhealthy},
		{"XID 48 double-bit ECC", func(n *fakenode.Node) error { return n.InjectXID(2, 48) }, []string{"gpu.tessera.dev/xid=48:NoSchedule"}, health.Unhealthy},
		{"XID 94 contained ECC", func(n *fakenode.Node) error { return n.InjectXID(2, 94) }, []string{"gpu.tessera.dev/xid=94:NoSchedule"}, health.Unhealthy},
		{"XID 13 is the application's", func(n *fakenode.Node) error { return n.InjectXID(2, 13) }, []string{"gpu.tessera.dev/xid=13:None"}, health.Healthy},
		{"double-bit ECC event", func(n *fakenode.Node) error { return n.InjectECC(2, true) }, []string{"gpu.tessera.dev/ecc=double-bit:NoSchedule"}, health.Unhealthy},
		{"lost GPU", func(n *fakenode.Node) error { return n.LoseGPU(2) }, []string{"gpu.tessera.dev/xid=79:NoSchedule"}, health.Unhealthy},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, "pcie-l4x4", nil)
			f.await("initial state", func(s health.Snapshot) bool { return len(s) == 4 })
			began := time.Now()
			if err := tc.inject(f.node); err != nil {
				t.Fatal(err)
			}
			s := f.await("taint on gpu-2", tainted(2))
			if took := time.Since(began); took > time.Second {
				t.Errorf("taint took %s, want under a second", took)
			}
			if diff := cmp.Diff(tc.want, taintsOf(s[2])); diff != "" {
				t.Errorf("gpu-2 taints (-want +got):\n%s", diff)
			}
			if got := s[2].Taints[0].TimeAdded.Time; !got.Equal(start) {
				t.Errorf("TimeAdded %s, want the event's time %s", got, start)
			}
			if s[2].Status != tc.status {
				t.Errorf("gpu-2 status %s, want %s", s[2].Status, tc.status)
			}
			for _, i := range []int{0, 1, 3} {
				if len(s[i].Taints) > 0 || s[i].Status != health.Healthy {
					t.Errorf("%s was touched: %s %v", s[i].Name, s[i].Status, taintsOf(s[i]))
				}
			}
		})
	}
}

func TestRecoveredGPUIsUntaintedAfterQuietPeriod(t *testing.T) {
	f := newFixture(t, "pcie-l4x4", nil)
	if err := f.node.InjectXID(1, 48); err != nil {
		t.Fatal(err)
	}
	f.await("taint on gpu-1", tainted(1))
	f.clock.Step(quiet - time.Second)
	f.probedAfter(f.clock.Now())
	if s := f.mon.State(); len(s[1].Taints) == 0 {
		t.Fatal("taint lifted before the quiet period ended")
	}
	f.clock.Step(time.Second)
	s := f.await("gpu-1 healthy", func(s health.Snapshot) bool { return s[1].Status == health.Healthy })
	if len(s[1].Taints) > 0 {
		t.Errorf("taints left after recovery: %v", taintsOf(s[1]))
	}
}

func TestLostGPUStaysTaintedWhileItDoesNotAnswer(t *testing.T) {
	f := newFixture(t, "pcie-l4x4", nil)
	if err := f.node.LoseGPU(3); err != nil {
		t.Fatal(err)
	}
	f.await("gpu-3 XID 79", tainted(3))
	for range 3 {
		f.clock.Step(quiet)
		f.probedAfter(f.clock.Now())
	}
	if diff := cmp.Diff([]string{"gpu.tessera.dev/lost=gpu-is-lost:NoSchedule", "gpu.tessera.dev/xid=79:NoSchedule"}, taintsOf(f.mon.State()[3])); diff != "" {
		t.Errorf("gpu-3 taints (-want +got):\n%s", diff)
	}
	if s := f.mon.State(); s[3].Status != health.Unhealthy {
		t.Fatalf("lost GPU became %s after quiet periods: %v", s[3].Status, taintsOf(s[3]))
	}
	if err := f.node.RecoverGPU(3); err != nil {
		t.Fatal(err)
	}
	f.clock.Step(time.Second) // a probe now passes, but the last failed one restarted the quiet period
	f.probedAfter(f.clock.Now())
	if s := f.mon.State(); s[3].Status != health.Unhealthy {
		t.Fatal("taint lifted without a quiet period after the last failed probe")
	}
	f.clock.Step(quiet)
	f.await("gpu-3 healthy", func(s health.Snapshot) bool { return s[3].Status == health.Healthy })
}

func TestGPULostBeforeStartIsTaintedWhenStartReturns(t *testing.T) {
	f := newFixture(t, "pcie-l4x4", func(n *fakenode.Node) {
		if err := n.LoseGPU(0); err != nil {
			t.Fatal(err)
		}
	})
	s := f.mon.State()
	if diff := cmp.Diff([]string{"gpu.tessera.dev/lost=gpu-is-lost:NoSchedule", "gpu.tessera.dev/unmonitored=gpu-is-lost:None"}, taintsOf(s[0])); diff != "" {
		t.Errorf("gpu-0 taints (-want +got):\n%s", diff)
	}
	if s[0].UUID == "" {
		t.Error("the lost GPU's UUID was not kept from discovery")
	}
}

func TestUnmonitorableGPUIsMarkedNotHealthy(t *testing.T) {
	f := newFixture(t, "pcie-l4x4", func(n *fakenode.Node) {
		if err := n.DisableEvents(1); err != nil {
			t.Fatal(err)
		}
	})
	s := f.mon.State()
	if diff := cmp.Diff([]string{"gpu.tessera.dev/unmonitored=not-supported:None"}, taintsOf(s[1])); diff != "" {
		t.Errorf("gpu-1 taints (-want +got):\n%s", diff)
	}
	if s[1].Status != health.Unknown {
		t.Errorf("gpu-1 status %s, want Unknown", s[1].Status)
	}
	if s[0].Status != health.Healthy {
		t.Errorf("gpu-0 status %s, want Healthy", s[0].Status)
	}
}

func TestEventsAreCounted(t *testing.T) {
	f := newFixture(t, "pcie-l4x4", nil)
	uuid := f.mon.State()[0].UUID
	for _, inject := range []func() error{
		func() error { return f.node.InjectECC(0, false) },
		func() error { return f.node.InjectECC(0, false) },
		func() error { return f.node.InjectXID(0, 13) },
		func() error { return f.node.InjectXID(0, 48) },
	} {
		if err := inject(); err != nil {
			t.Fatal(err)
		}
	}
	f.await("gpu-0 unhealthy", func(s health.Snapshot) bool { return s[0].Status == health.Unhealthy })
	for _, c := range []struct {
		kind, xid string
		want      float64
	}{{"ecc-single-bit", "", 2}, {"xid", "13", 1}, {"xid", "48", 1}, {"ecc-double-bit", "", 0}} {
		if got := testutil.ToFloat64(f.metrics.Events.WithLabelValues("gpu-0", uuid, c.kind, c.xid)); got != c.want {
			t.Errorf("tessera_health_events_total{kind=%q,xid=%q} = %v, want %v", c.kind, c.xid, got, c.want)
		}
	}
	if got := testutil.ToFloat64(f.metrics.Healthy.WithLabelValues("gpu-0")); got != 0 {
		t.Errorf("tessera_device_healthy{gpu-0} = %v, want 0", got)
	}
	if got := testutil.ToFloat64(f.metrics.Healthy.WithLabelValues("gpu-1")); got != 1 {
		t.Errorf("tessera_device_healthy{gpu-1} = %v, want 1", got)
	}
}
