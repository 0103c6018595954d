package plugin_test

import (
	"context"
	"errors"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/tessera-dev/tessera/deviceclass"
	"github.com/tessera-dev/tessera/driver/fakenode"
	"github.com/tessera-dev/tessera/driver/features"
	"github.com/tessera-dev/tessera/driver/health"
	"github.com/tessera-dev/tessera/driver/plugin"
	"github.com/tessera-dev/tessera/driver/simulate"
)

var healthStart = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

const healthQuiet = time.Minute

type healthHarness struct {
	*harness
	node  *fakenode.Node
	clock *testingclock.FakeClock
}

// startHealth runs the plugin on a fake node the test keeps driving, with a
// fake clock for health. gates ("DeviceHealth=false") adjust the defaults.
func startHealth(t *testing.T, profile string, gates ...string) *healthHarness {
	t.Helper()
	fg := features.New()
	for _, g := range gates {
		if err := fg.Set(g); err != nil {
			t.Fatal(err)
		}
	}
	clk := testingclock.NewFakeClock(healthStart)
	h, n := startOnFakeNode(t, profile, func(o *plugin.Options) {
		o.Health = health.Options{QuietPeriod: healthQuiet, ProbeInterval: time.Second, WaitTimeout: 10 * time.Millisecond, Clock: clk}
		o.FeatureGates = fg
	})
	return &healthHarness{node: n, clock: clk, harness: h}
}

// publishedTaints returns the published devices and their taints as
// key=value:effect, or false while a device is missing.
func (h *healthHarness) publishedTaints() (map[string][]string, []*resourceapi.ResourceSlice) {
	list, err := h.client.ResourceV1().ResourceSlices().List(h.ctx, metav1.ListOptions{})
	if err != nil {
		h.t.Fatal(err)
	}
	out := map[string][]string{}
	var slices []*resourceapi.ResourceSlice
	for i := range list.Items {
		s := &list.Items[i]
		slices = append(slices, s)
		for _, d := range s.Spec.Devices {
			out[d.Name] = []string{}
			for _, t := range d.Taints {
				out[d.Name] = append(out[d.Name], t.Key+"="+t.Value+":"+string(t.Effect))
			}
		}
	}
	return out, slices
}

// awaitSlices polls the fake API server until ok holds (10 s bound).
func (h *healthHarness) awaitSlices(what string, ok func(map[string][]string) bool) []*resourceapi.ResourceSlice {
	h.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		taints, slices := h.publishedTaints()
		if ok(taints) {
			return slices
		}
		if time.Now().After(deadline) {
			h.t.Fatalf("%s: not published; devices and taints now: %v", what, taints)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// sliceWrites counts the writes to ResourceSlices the fake API server took.
func (h *healthHarness) sliceWrites() int {
	n := 0
	for _, a := range h.client.Actions() {
		if a.GetResource().Resource == "resourceslices" && slices.Contains([]string{"create", "update", "delete"}, a.GetVerb()) {
			n++
		}
	}
	return n
}

// awaitSliceController waits until kubeletplugin's ResourceSlice controller
// runs: the plugin writes a fresh node's first slices itself, then hands
// them to the controller, whose start returns only once its informer has
// synced, with the pool queued for its worker; the plugin counts the
// published devices (tessera_published_devices) once that returns.
// Changes made after this are synced by the running controller, so what
// they cost (latency, writes) is the steady state's.
func (h *healthHarness) awaitSliceController() {
	h.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for gauge(h.t, h.plugin, "tessera_published_devices") == 0 {
		if time.Now().After(deadline) {
			h.t.Fatal("the plugin never handed its devices to the ResourceSlice controller")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// gauge is the value of one of the plugin's gauges.
func gauge(t *testing.T, p *plugin.Plugin, name string) float64 {
	t.Helper()
	families, err := p.Metrics().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() == name {
			return f.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatalf("no gauge %s", name)
	return 0
}

// watchHealth calls WatchHealthStatus as the kubelet's stream would.
func (h *healthHarness) watchHealth(ctx context.Context) (<-chan kubeletplugin.DeviceHealthReport, <-chan error) {
	reports := make(chan kubeletplugin.DeviceHealthReport)
	errc := make(chan error, 1)
	go func() { errc <- h.plugin.Driver().WatchHealthStatus(ctx, reports) }()
	return reports, errc
}

func healthOf(r kubeletplugin.DeviceHealthReport) map[string]kubeletplugin.HealthStatus {
	out := map[string]kubeletplugin.HealthStatus{}
	for _, d := range r.Devices {
		if d.PoolName != nodeName {
			continue
		}
		out[d.DeviceName] = d.Health
	}
	return out
}

func awaitReport(t *testing.T, reports <-chan kubeletplugin.DeviceHealthReport, ok func(map[string]kubeletplugin.HealthStatus) bool) map[string]kubeletplugin.HealthStatus {
	t.Helper()
	deadline := time.After(10 * time.Second)
	var last map[string]kubeletplugin.HealthStatus
	for {
		select {
		case r := <-reports:
			if last = healthOf(r); ok(last) {
				return last
			}
		case <-deadline:
			t.Fatalf("health report not seen; last %v", last)
		}
	}
}

func allHealthyBut(device string, status kubeletplugin.HealthStatus) map[string]kubeletplugin.HealthStatus {
	out := map[string]kubeletplugin.HealthStatus{}
	for _, d := range []string{"gpu-0", "gpu-1", "gpu-2", "gpu-3"} {
		out[d] = kubeletplugin.HealthStatusHealthy
	}
	if device != "" {
		out[device] = status
	}
	return out
}

func TestFaultedGPUIsTaintedInPublishedSlicesAndReported(t *testing.T) {
	for _, tc := range []struct {
		name   string
		inject func(*fakenode.Node) error
		taint  string
		health kubeletplugin.HealthStatus
	}{
		{"XID 79", func(n *fakenode.Node) error { return n.InjectXID(1, 79) }, "gpu.tessera.dev/xid=79:NoSchedule", kubeletplugin.HealthStatusUnhealthy},
		{"XID 48", func(n *fakenode.Node) error { return n.InjectXID(1, 48) }, "gpu.tessera.dev/xid=48:NoSchedule", kubeletplugin.HealthStatusUnhealthy},
		{"XID 94", func(n *fakenode.Node) error { return n.InjectXID(1, 94) }, "gpu.tessera.dev/xid=94:NoSchedule", kubeletplugin.HealthStatusUnhealthy},
		{"XID 13 is informational", func(n *fakenode.Node) error { return n.InjectXID(1, 13) }, "gpu.tessera.dev/xid=13:None", kubeletplugin.HealthStatusHealthy},
		{"double-bit ECC", func(n *fakenode.Node) error { return n.InjectECC(1, true) }, "gpu.tessera.dev/ecc=double-bit:NoSchedule", kubeletplugin.HealthStatusUnhealthy},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := startHealth(t, "pcie-l4x4")
			h.awaitSlices("initial slices", func(m map[string][]string) bool { return len(m) == 4 })
			h.awaitSliceController()
			reports, _ := h.watchHealth(h.ctx)
			awaitReport(t, reports, func(m map[string]kubeletplugin.HealthStatus) bool {
				return cmp.Equal(m, allHealthyBut("", ""))
			})
			began := time.Now()
			if err := tc.inject(h.node); err != nil {
				t.Fatal(err)
			}
			slices := h.awaitSlices("taint on gpu-1", func(m map[string][]string) bool { return len(m["gpu-1"]) > 0 })
			if took := time.Since(began); took > time.Second {
				t.Errorf("event to published taint took %s, want under a second", took)
			}
			got, _ := h.publishedTaints()
			want := map[string][]string{"gpu-0": {}, "gpu-1": {tc.taint}, "gpu-2": {}, "gpu-3": {}}
			if diff := cmp.Diff(want, got); diff != "" {
				t.Errorf("published taints (-want +got):\n%s", diff)
			}
			for _, s := range slices {
				for _, d := range s.Spec.Devices {
					if len(d.Taints) > 0 && !d.Taints[0].TimeAdded.Time.Equal(healthStart) {
						t.Errorf("%s TimeAdded %s, want the event's time %s", d.Name, d.Taints[0].TimeAdded, healthStart)
					}
				}
			}
			awaitReport(t, reports, func(m map[string]kubeletplugin.HealthStatus) bool {
				return cmp.Equal(m, allHealthyBut("gpu-1", tc.health))
			})
		})
	}
}

// oneGPUClaim asks for one GPU, tolerating the given taint key if any.
func oneGPUClaim(name, tolerate string) *resourceapi.ResourceClaim {
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default", UID: types.UID("uid-" + name)}}
	r := resourceapi.DeviceRequest{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{
		DeviceClassName: driverName, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1,
	}}
	if tolerate != "" {
		r.Exactly.Tolerations = []resourceapi.DeviceToleration{{Key: tolerate, Operator: resourceapi.DeviceTolerationOpExists, Effect: resourceapi.DeviceTaintEffectNoSchedule}}
	}
	c.Spec.Devices.Requests = []resourceapi.DeviceRequest{r}
	return c
}

func TestAllocatorSkipsTheTaintedGPUUnlessTolerated(t *testing.T) {
	h := startHealth(t, "pcie-l4x4")
	if err := h.node.InjectXID(0, 48); err != nil {
		t.Fatal(err)
	}
	published := h.awaitSlices("taint on gpu-0", func(m map[string][]string) bool { return len(m["gpu-0"]) > 0 && len(m) == 4 })
	classes, err := deviceclass.All()
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name     string
		tolerate string
		want     []string // devices the four claims get, in order; "" for "does not fit"
	}{
		{name: "no toleration", want: []string{"gpu-1", "gpu-2", "gpu-3", ""}},
		{name: "tolerating the XID taint", tolerate: "gpu.tessera.dev/xid", want: []string{"gpu-0", "gpu-1", "gpu-2", "gpu-3"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := simulate.New(classes, published)
			var got []string
			for i := range 4 {
				res, err := c.Allocate(h.ctx, nodeName, oneGPUClaim(tc.name+"-"+string(rune('a'+i)), tc.tolerate))
				if err != nil {
					t.Fatal(err)
				}
				if res == nil {
					got = append(got, "")
					continue
				}
				c.Commit(res...)
				got = append(got, res[0].Devices.Results[0].Device)
			}
			if diff := cmp.Diff(tc.want, sortedKeepingEmptyLast(got)); diff != "" {
				t.Errorf("allocations (-want +got):\n%s", diff)
			}
		})
	}
}

// sortedKeepingEmptyLast sorts device names, "does not fit" last.
func sortedKeepingEmptyLast(s []string) []string {
	out := append([]string(nil), s...)
	sort.Slice(out, func(i, j int) bool {
		if (out[i] == "") != (out[j] == "") {
			return out[j] == ""
		}
		return out[i] < out[j]
	})
	return out
}

func TestHealthStreamResendsAndEndsWithItsContext(t *testing.T) {
	h := startHealth(t, "pcie-l4x4")
	ctx, cancel := context.WithCancel(h.ctx)
	reports, errc := h.watchHealth(ctx)
	awaitReport(t, reports, func(m map[string]kubeletplugin.HealthStatus) bool { return len(m) == 4 })
	// No change, yet the kubelet's lease must be renewed.
	h.clock.Step(plugin.HealthResendInterval)
	awaitReport(t, reports, func(m map[string]kubeletplugin.HealthStatus) bool { return cmp.Equal(m, allHealthyBut("", "")) })
	// The kubelet stops reading, then goes away: the stream must not hang.
	h.clock.Step(plugin.HealthResendInterval)
	cancel()
	select {
	case err := <-errc:
		if err != nil {
			t.Errorf("WatchHealthStatus returned %v, want nil", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("WatchHealthStatus still blocked after its context ended")
	}
}

func TestRecoveredGPUIsUntaintedAndReportedHealthy(t *testing.T) {
	h := startHealth(t, "pcie-l4x4")
	reports, _ := h.watchHealth(h.ctx)
	if err := h.node.InjectXID(2, 48); err != nil {
		t.Fatal(err)
	}
	h.awaitSlices("taint on gpu-2", func(m map[string][]string) bool { return len(m["gpu-2"]) > 0 })
	awaitReport(t, reports, func(m map[string]kubeletplugin.HealthStatus) bool {
		return m["gpu-2"] == kubeletplugin.HealthStatusUnhealthy
	})
	h.clock.Step(healthQuiet)
	h.awaitSlices("gpu-2 untainted", func(m map[string][]string) bool { return len(m) == 4 && len(m["gpu-2"]) == 0 })
	awaitReport(t, reports, func(m map[string]kubeletplugin.HealthStatus) bool { return cmp.Equal(m, allHealthyBut("", "")) })
}

func TestRestartWithALostGPUKeepsItOutOfService(t *testing.T) {
	h := startHealth(t, "pcie-l4x4")
	if err := h.node.LoseGPU(3); err != nil {
		t.Fatal(err)
	}
	h.awaitSlices("taint on gpu-3", func(m map[string][]string) bool { return len(m["gpu-3"]) > 0 })
	h.restart()
	// Re-derived at start: the probe finds the GPU lost before anything is
	// published or reported; the XID seen before the restart is kept.
	s := h.plugin.Health().State()[3]
	if s.Status != health.Unhealthy {
		t.Fatalf("after restart gpu-3 is %s: %v", s.Status, s.Taints)
	}
	reports, _ := h.watchHealth(h.ctx)
	awaitReport(t, reports, func(m map[string]kubeletplugin.HealthStatus) bool {
		return cmp.Equal(m, allHealthyBut("gpu-3", kubeletplugin.HealthStatusUnhealthy))
	})
	// Discovery cannot describe a lost GPU; its last-known description is
	// published, tainted, so nothing is allocated on it without tolerating
	// the taints.
	want := []string{"gpu.tessera.dev/lost=gpu-is-lost:NoSchedule", "gpu.tessera.dev/unmonitored=gpu-is-lost:None", "gpu.tessera.dev/xid=79:NoSchedule"}
	h.awaitSlices("gpu-3 tainted lost", func(m map[string][]string) bool { return len(m) == 4 && cmp.Equal(m["gpu-3"], want) })
}

func TestDeviceHealthGateOffReportsNotSupported(t *testing.T) {
	h := startHealth(t, "pcie-l4x4", "DeviceHealth=false")
	if h.plugin.Health() != nil {
		t.Error("health monitor runs with the gate off")
	}
	_, errc := h.watchHealth(h.ctx)
	if err := <-errc; !errors.Is(err, kubeletplugin.ErrHealthNotSupported) {
		t.Errorf("WatchHealthStatus: %v, want ErrHealthNotSupported", err)
	}
}

// TestAHealthChangeRewritesEverySliceItsGPUSpans pins what one GPU's health
// change costs in API writes (docs/performance.md, "Publishing at scale").
// The upstream ResourceSlice controller keeps a pool's generation only when
// at most one of its slices changes; otherwise it bumps the generation and
// rewrites every slice. On whole-GPU nodes a GPU is one device in one slice:
// one write. With dynamic MIG the device order (inventory.Pack: whole GPUs
// first, then each profile across GPUs) spreads every GPU's devices over
// several slices, so a taint on one GPU rewrites all of the node's slices.
// Published lazily (LazyMIG, on by default) an empty DGX H100's 33 devices
// fit one slice beside the counter sets: one write.
func TestAHealthChangeRewritesEverySliceItsGPUSpans(t *testing.T) {
	for _, tc := range []struct {
		name, profile string
		gates         []string
		devices       int
		spanned       int // slices holding a device of GPU 1
		wantRewrites  int
	}{
		{name: "pcie-l4x4", profile: "pcie-l4x4", devices: 4, spanned: 1, wantRewrites: 1},
		{name: "dgx-h100-every-partition", profile: "dgx-h100", gates: []string{"LazyMIG=false"}, devices: 208, spanned: 3, wantRewrites: 5},
		{name: "dgx-h100-lazily", profile: "dgx-h100", devices: 33, spanned: 1, wantRewrites: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := startHealth(t, tc.profile, tc.gates...)
			published := h.awaitSlices("initial slices", func(m map[string][]string) bool { return len(m) == tc.devices })
			h.awaitSliceController()
			writes := h.sliceWrites
			before := writes()
			// Every device of GPU 1: the whole GPU and, with dynamic MIG,
			// its partitions (named gpu-1-mig-...).
			ofGPU1 := func(name string) bool { return name == "gpu-1" || strings.HasPrefix(name, "gpu-1-") }
			spanned := 0
			for _, s := range published {
				if slices.ContainsFunc(s.Spec.Devices, func(d resourceapi.Device) bool { return ofGPU1(d.Name) }) {
					spanned++
				}
			}
			if spanned != tc.spanned {
				t.Fatalf("GPU 1's devices are in %d of %d slices, want %d", spanned, len(published), tc.spanned)
			}
			if err := h.node.InjectXID(1, 79); err != nil {
				t.Fatal(err)
			}
			// Done once every device of GPU 1 is tainted and every slice
			// carries the pool's newest generation (a bumped generation
			// reaches the slices one write at a time).
			var now []*resourceapi.ResourceSlice
			h.awaitSlices("taint on every device of GPU 1, one generation", func(m map[string][]string) bool {
				for name, taints := range m {
					if ofGPU1(name) && len(taints) == 0 {
						return false
					}
				}
				_, now = h.publishedTaints()
				for _, s := range now {
					if s.Spec.Pool.Generation != now[0].Spec.Pool.Generation {
						return false
					}
				}
				return true
			})
			if got := writes() - before; got != tc.wantRewrites || got > len(now) {
				t.Errorf("one GPU's taint cost %d slice writes on a node of %d slices, want %d", got, len(now), tc.wantRewrites)
			}
		})
	}
}
