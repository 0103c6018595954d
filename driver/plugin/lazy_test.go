package plugin_test

import (
	"fmt"
	"maps"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/tessera-dev/tessera/driver/features"
	"github.com/tessera-dev/tessera/driver/health"
	"github.com/tessera-dev/tessera/driver/lazymig"
	"github.com/tessera-dev/tessera/driver/nodelock"
	"github.com/tessera-dev/tessera/driver/plugin"
	tslices "github.com/tessera-dev/tessera/driver/slices"
	"github.com/tessera-dev/tessera/test/kubeletsim"
)

// partitionsPerH100 is how many partitions dynamic MIG publishes per H100
// (every profile at every placement NVML lists for it).
const partitionsPerH100 = 25

const lazyGrace = 10 * time.Minute

func startLazy(t *testing.T, adjust ...func(*plugin.Options)) (*healthHarness, *testingclock.FakeClock) {
	t.Helper()
	clk := testingclock.NewFakeClock(healthStart)
	h, n := startOnFakeNode(t, "dgx-h100", func(o *plugin.Options) {
		o.Clock = clk
		o.MIGWithdrawGrace = lazyGrace
		o.Health = health.Options{QuietPeriod: 24 * time.Hour, ProbeInterval: time.Second, WaitTimeout: 10 * time.Millisecond, Clock: clk}
		for _, f := range adjust {
			f(o)
		}
	})
	return &healthHarness{node: n, clock: clk, harness: h}, clk
}

var partitionOf = regexp.MustCompile(`^(gpu-\d+)-mig-`)

// lazyState sums up what the slices publish: per GPU with partitions,
// "open" when all of them are published without the withdrawal taint,
// "closing" when all carry it, else what is odd about them.
func lazyState(devices map[string][]string) map[string]string {
	count, tainted := map[string]int{}, map[string]int{}
	for name, taints := range devices {
		m := partitionOf.FindStringSubmatch(name)
		if m == nil {
			continue
		}
		count[m[1]]++
		if slices.ContainsFunc(taints, func(t string) bool { return strings.HasPrefix(t, lazymig.TaintKey+"=") }) {
			tainted[m[1]]++
		}
	}
	out := map[string]string{}
	for gpu, n := range count {
		switch {
		case n != partitionsPerH100:
			out[gpu] = fmt.Sprintf("%d partitions", n)
		case tainted[gpu] == 0:
			out[gpu] = "open"
		case tainted[gpu] == n:
			out[gpu] = "closing"
		default:
			out[gpu] = fmt.Sprintf("%d of %d tainted", tainted[gpu], n)
		}
	}
	return out
}

func (h *healthHarness) awaitLazy(step string, want map[string]string) {
	h.t.Helper()
	h.awaitSlices(fmt.Sprintf("%s: want partitions %v", step, want), func(m map[string][]string) bool { return lazyShows(m, want) })
}

// lazyShows says whether the published devices show want (lazyState)
// and nothing else beside a DGX H100's eight whole GPUs.
func lazyShows(devices map[string][]string, want map[string]string) bool {
	return maps.Equal(lazyState(devices), want) && len(devices) == 8+partitionsPerH100*len(want)
}

// republished makes the plugin decide and publish again now, by a fault
// on a whole GPU (never a spare: gpu-7 is), and checks what that publish
// holds: waiting for an unchanged state alone would pass before the
// plugin had decided anything.
func (h *healthHarness) republished(step string, gpu int, want map[string]string) {
	h.t.Helper()
	if err := h.node.InjectXID(gpu, 48); err != nil {
		h.t.Fatal(err)
	}
	name := fmt.Sprintf("gpu-%d", gpu)
	h.awaitSlices(fmt.Sprintf("%s: want %s tainted", step, name), func(m map[string][]string) bool { return len(m[name]) > 0 })
	taints, _ := h.publishedTaints()
	if got := lazyState(taints); !maps.Equal(got, want) || len(taints) != 8+partitionsPerH100*len(want) {
		h.t.Fatalf("%s: published partitions %v (%d devices), want %v", step, got, len(taints), want)
	}
}

// closingSince is the withdrawal taint's time on gpu's partitions.
func (h *healthHarness) closingSince(gpu string) time.Time {
	h.t.Helper()
	_, sl := h.publishedTaints()
	for _, s := range sl {
		for _, d := range s.Spec.Devices {
			if !strings.HasPrefix(d.Name, gpu+"-mig-") {
				continue
			}
			for _, t := range d.Taints {
				if t.Key == lazymig.TaintKey && t.TimeAdded != nil {
					return t.TimeAdded.Time
				}
			}
		}
	}
	h.t.Fatalf("%s's partitions carry no withdrawal taint", gpu)
	return time.Time{}
}

// TestLazyMIGFollowsTheNodesPartitions drives one DGX H100 through the
// life of lazy publishing (driver/lazymig): the next GPU opens when one is
// partitioned; a freed GPU is tainted, and withdrawn only after the grace
// and only if no claim in the API is still allocated one of its partitions;
// a partition prepared during the grace reopens it; a restart keeps the
// countdown the API shows, and, when the API shows nothing, publishes the
// partitions of GPUs that claims in the API are allocated; a GPU held whole
// loses its partitions at once.
func TestLazyMIGFollowsTheNodesPartitions(t *testing.T) {
	h, clk := startLazy(t)
	h.awaitLazy("empty node", map[string]string{"gpu-7": "open"})

	prepare := func(c kubeletsim.Claim) {
		t.Helper()
		if _, errMsg := h.prepare(c); errMsg != "" {
			t.Fatalf("prepare %s: %s", c.Name, errMsg)
		}
	}
	unprepare := func(c kubeletsim.Claim) {
		t.Helper()
		resp, err := h.kubelet.Unprepare(h.ctx, c)
		if err != nil || resp.Claims[string(c.UID)].GetError() != "" {
			t.Fatalf("unprepare %s: %v %v", c.Name, err, resp)
		}
	}
	deleteClaim := func(c kubeletsim.Claim) {
		t.Helper()
		if err := h.client.ResourceV1().ResourceClaims(c.Namespace).Delete(h.ctx, c.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}

	// Opening and closing a GPU's partitions is one write: its whole
	// device and partitions change in the device slice; the counter sets
	// stay.
	h.awaitSliceController() // its first sync after the plugin's own first write is not what is counted
	before := h.sliceWrites()
	writes := func() int {
		n := h.sliceWrites() - before
		before += n
		return n
	}
	a := h.claim("a", "gpu-7-mig-1g10gb-6")
	prepare(a)
	h.awaitLazy("a 1g on gpu-7", map[string]string{"gpu-7": "open", "gpu-6": "open"})
	if n := writes(); n != 1 {
		t.Errorf("opening gpu-6 wrote %d slices, want 1", n)
	}
	unprepare(a)
	deleteClaim(a)
	h.awaitLazy("a released", map[string]string{"gpu-7": "open", "gpu-6": "closing"})
	if n := writes(); n != 1 {
		t.Errorf("tainting gpu-6's partitions wrote %d slices, want 1", n)
	}
	h.closingSince("gpu-6")

	// Allocated on gpu-6 before the scheduler saw the taint, prepared now.
	c := h.claim("c", "gpu-6-mig-2g20gb-4")
	prepare(c)
	h.awaitLazy("c 2g on the closing gpu-6", map[string]string{"gpu-7": "open", "gpu-6": "open"})
	// Unprepared, but still allocated in the API (as a claim whose pod
	// waits to start is): the grace ends without a withdrawal, and counts
	// again.
	unprepare(c)
	h.awaitLazy("c unprepared", map[string]string{"gpu-7": "open", "gpu-6": "closing"})
	since := h.closingSince("gpu-6")
	clk.Step(lazyGrace)
	h.awaitSlices("the grace counted again while c is allocated", func(m map[string][]string) bool {
		return maps.Equal(lazyState(m), map[string]string{"gpu-7": "open", "gpu-6": "closing"}) && h.closingSince("gpu-6").After(since)
	})
	since = h.closingSince("gpu-6")
	deleteClaim(c)

	// A restart goes on with the countdown the API shows.
	clk.Step(lazyGrace / 2)
	h.restart()
	h.republished("after a restart", 0, map[string]string{"gpu-7": "open", "gpu-6": "closing"})
	if got := h.closingSince("gpu-6"); !got.Equal(since) {
		t.Fatalf("after a restart gpu-6 is closing since %v, want the countdown the API showed, since %v", got, since)
	}
	clk.Step(lazyGrace/2 - time.Second)
	h.republished("a second before the grace ends", 1, map[string]string{"gpu-7": "open", "gpu-6": "closing"})
	clk.Step(time.Second)
	h.awaitLazy("the grace is over", map[string]string{"gpu-7": "open"})

	// A restart after the kubelet deleted the node's slices: the scheduler
	// may hold allocations it made from them, so every free GPU's
	// partitions are published, tainted, and a claim in the API allocated
	// a partition of gpu-5 that the kubelet has not asked to prepare keeps
	// gpu-5's published untainted.
	h.claim("r", "gpu-5-mig-3g40gb-4")
	h.plugin.Stop()
	_, sl := h.publishedTaints()
	for _, s := range sl {
		if err := h.client.ResourceV1().ResourceSlices().Delete(h.ctx, s.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	h.restart()
	wiped := map[string]string{"gpu-7": "open", "gpu-5": "open"}
	for _, g := range []string{"gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-4", "gpu-6"} {
		wiped[g] = "closing"
	}
	h.awaitLazy("a restart after the slices were deleted", wiped)

	b := h.claim("b", "gpu-7")
	prepare(b)
	delete(wiped, "gpu-7")
	wiped["gpu-6"], wiped["gpu-5"] = "open", "closing"
	h.awaitLazy("gpu-7 held whole", wiped)
}

// TestPartitionsAnotherInstancePublishedAreWithdrawnOnlyAfterTheGrace: in a
// rolling update two instances publish the node's pool; partitions the
// other one published (here written straight into the API) count as
// published, so this one taints them and waits rather than drop them. A
// taint the other instance stamped earlier counts from when this one first
// saw it.
func TestPartitionsAnotherInstancePublishedAreWithdrawnOnlyAfterTheGrace(t *testing.T) {
	h, clk := startLazy(t)
	h.awaitLazy("empty node", map[string]string{"gpu-7": "open"})
	// The other instance writes once this one's slice controller runs:
	// before, its writes would race this plugin's own first ones.
	h.awaitSliceController()
	res, err := tslices.Build(nodeName, h.plugin.Manager().Inventory(), tslices.Options{})
	if err != nil {
		t.Fatal(err)
	}
	var gpu4 []resourceapi.Device
	for _, s := range res.Pools[nodeName].Slices {
		for _, d := range s.Devices {
			if strings.HasPrefix(d.Name, "gpu-4-mig-") {
				gpu4 = append(gpu4, d)
			}
		}
	}
	// writeAsOther publishes gpu-4's partitions (with taint, if set) into
	// the device slice, as the other instance does.
	writeAsOther := func(taint *resourceapi.DeviceTaint) {
		t.Helper()
		_, published := h.publishedTaints()
		for _, s := range published {
			if len(s.Spec.Devices) == 0 {
				continue
			}
			s.Spec.Devices = slices.DeleteFunc(s.Spec.Devices, func(d resourceapi.Device) bool { return strings.HasPrefix(d.Name, "gpu-4-mig-") })
			for _, d := range gpu4 {
				if taint != nil {
					d.Taints = []resourceapi.DeviceTaint{*taint}
				}
				s.Spec.Devices = append(s.Spec.Devices, d)
			}
			if _, err := h.client.ResourceV1().ResourceSlices().Update(h.ctx, s, metav1.UpdateOptions{}); err != nil {
				t.Fatal(err)
			}
			return
		}
		t.Fatal("no device slice")
	}
	// otherInstance writes as the other instance until this one shows
	// want: the other instance's controller keeps its slices as it wants
	// them, so it writes again what this one's controller overwrote
	// before this plugin saw it (this controller's first sync may still
	// be pending when the test first writes).
	otherInstance := func(taint *resourceapi.DeviceTaint, step string, want map[string]string) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			writeAsOther(taint)
			for again := time.Now().Add(time.Second); time.Now().Before(again); time.Sleep(5 * time.Millisecond) {
				if taints, _ := h.publishedTaints(); lazyShows(taints, want) {
					return
				}
			}
			if time.Now().After(deadline) {
				taints, _ := h.publishedTaints()
				t.Fatalf("%s: want partitions %v, published %v", step, want, lazyState(taints))
			}
		}
	}

	otherInstance(nil, "gpu-4's partitions published by another instance", map[string]string{"gpu-7": "open", "gpu-4": "closing"})
	if got := h.closingSince("gpu-4"); !got.Equal(clk.Now()) {
		t.Fatalf("gpu-4 closing since %v, want since it was seen, %v", got, clk.Now())
	}
	clk.Step(lazyGrace)
	h.awaitWithdrawn(clk, "the grace is over", map[string]string{"gpu-7": "open"})

	stamped := clk.Now().Add(-lazyGrace / 2)
	otherInstance(&resourceapi.DeviceTaint{Key: lazymig.TaintKey, Effect: resourceapi.DeviceTaintEffectNoSchedule, TimeAdded: &metav1.Time{Time: stamped}},
		"gpu-4's partitions published and tainted by another instance", map[string]string{"gpu-7": "open", "gpu-4": "closing"})
	clk.Step(lazyGrace - time.Second)
	h.republished("a second before the grace ends, counted from when the taint was seen", 0, map[string]string{"gpu-7": "open", "gpu-4": "closing"})
	clk.Step(time.Second)
	h.awaitWithdrawn(clk, "the grace is over", map[string]string{"gpu-7": "open"})
}

// awaitWithdrawn waits for want after a grace ended. The other instance's
// writes race this one's slice controller: when the plugin's check of the
// API catches a moment its taint is not shown, it counts the grace again
// (the safe side), so one more grace is allowed, never less.
func (h *healthHarness) awaitWithdrawn(clk *testingclock.FakeClock, step string, want map[string]string) {
	h.t.Helper()
	deadline := time.Now().Add(3 * time.Second)
	for time.Now().Before(deadline) {
		taints, _ := h.publishedTaints()
		if maps.Equal(lazyState(taints), want) {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
	clk.Step(lazyGrace)
	h.awaitLazy(step+", counted again once", want)
}

// TestAPrepareInFlightOnTheSpareOpensNoOtherGPU: while a partition of the
// spare is being prepared (held up here by its claim's lock, as the other
// instance of a rolling update holds it), the node publishes what it did
// before, so a prepare that fails, and each retry of it, rewrites nothing.
// The spare moves on, in one write, once the claim is held.
func TestAPrepareInFlightOnTheSpareOpensNoOtherGPU(t *testing.T) {
	h, _ := startLazy(t, func(o *plugin.Options) { o.PodUID = "pod-a" })
	h.awaitLazy("empty node", map[string]string{"gpu-7": "open"})
	h.awaitSliceController()
	c := h.claim("a", "gpu-7-mig-1g10gb-6")
	unlock, err := nodelock.New(h.opts.PluginDataDir).LockClaim(c.UID)
	if err != nil {
		t.Fatal(err)
	}
	released := false
	release := func() {
		if !released {
			released = true
			unlock()
		}
	}
	t.Cleanup(release) // first: the plugin's Stop waits for the prepare
	done := make(chan string, 1)
	go func() {
		resp, err := h.kubelet.Prepare(h.ctx, c)
		if err != nil {
			done <- err.Error()
			return
		}
		done <- resp.Claims[string(c.UID)].GetError()
	}()
	deadline := time.Now().Add(10 * time.Second)
	for gauge(t, h.plugin, "tessera_prepares_in_flight") == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the prepare never started")
		}
		time.Sleep(5 * time.Millisecond)
	}
	// The prepare is in flight, waiting for the claim's lock. A fault on
	// gpu-0 makes the plugin decide and publish now; that one write is all.
	before := h.sliceWrites()
	h.republished("a partition of the spare being prepared", 0, map[string]string{"gpu-7": "open"})
	if n := h.sliceWrites() - before; n != 1 {
		t.Errorf("publishing gpu-0's fault during the prepare wrote %d slices, want 1", n)
	}
	release()
	if msg := <-done; msg != "" {
		t.Fatalf("prepare: %s", msg)
	}
	before = h.sliceWrites()
	h.awaitLazy("the claim held on gpu-7", map[string]string{"gpu-7": "open", "gpu-6": "open"})
	if n := h.sliceWrites() - before; n != 1 {
		t.Errorf("opening gpu-6 wrote %d slices, want 1", n)
	}
}

// TestABurstOfPodsWritesTheSlicesAtMostOncePerInterval: a node whose pods
// start and end in a burst (here: a 1g partition of the spare and the spare
// whole, prepared and unprepared in turn, each of which opens or closes a
// GPU) writes its slices at most once per --mig-publish-interval, the
// first change at once, and ends publishing what it holds at the end.
func TestABurstOfPodsWritesTheSlicesAtMostOncePerInterval(t *testing.T) {
	const interval = 100 * time.Millisecond
	h, _ := startLazy(t, func(o *plugin.Options) { o.MIGPublishInterval = interval })
	h.awaitLazy("empty node", map[string]string{"gpu-7": "open"})
	h.awaitSliceController()
	part, whole := h.claim("part", "gpu-7-mig-1g10gb-6"), h.claim("whole", "gpu-7")
	before := h.sliceWrites()
	began := time.Now()
	const cycles = 100
	for i := range cycles {
		c := part
		if i%2 == 1 {
			c = whole
		}
		if _, msg := h.prepare(c); msg != "" {
			t.Fatalf("prepare %s: %s", c.Name, msg)
		}
		if resp, err := h.kubelet.Unprepare(h.ctx, c); err != nil || resp.Claims[string(c.UID)].GetError() != "" {
			t.Fatalf("unprepare %s: %v %v", c.Name, err, resp)
		}
	}
	burst := time.Since(began)
	// Everything free again: gpu-7 is the spare, and gpu-6, opened while
	// gpu-7 was held, may still be closing.
	h.awaitSlices("after the burst", func(m map[string][]string) bool {
		s := lazyState(m)
		return s["gpu-7"] == "open" && (len(s) == 1 || len(s) == 2 && s["gpu-6"] == "closing")
	})
	writes := h.sliceWrites() - before
	// One write at once, then at most one per interval begun, and the one
	// that ends the last interval.
	bound := 2 + int(burst/interval)
	if writes > bound {
		t.Errorf("%d cycles in %v wrote the slices %d times, want at most %d (one per %v)", cycles, burst.Round(time.Millisecond), writes, bound, interval)
	}
	t.Logf("%d cycles in %v: %d slice writes", cycles, burst.Round(time.Millisecond), writes)
}

// taintGPU6 opens gpu-6 (a 1g partition of the spare prepared), then frees
// it, each published by a health change (the tests using it pace everything
// else for an hour), and returns the withdrawal taint's stamp.
func (h *healthHarness) taintGPU6() time.Time {
	h.t.Helper()
	a := h.claim("a", "gpu-7-mig-1g10gb-6")
	if _, msg := h.prepare(a); msg != "" {
		h.t.Fatal(msg)
	}
	h.republished("a 1g on gpu-7", 0, map[string]string{"gpu-7": "open", "gpu-6": "open"})
	if resp, err := h.kubelet.Unprepare(h.ctx, a); err != nil || resp.Claims[string(a.UID)].GetError() != "" {
		h.t.Fatalf("unprepare: %v %v", err, resp)
	}
	if err := h.client.ResourceV1().ResourceClaims(a.Namespace).Delete(h.ctx, a.Name, metav1.DeleteOptions{}); err != nil {
		h.t.Fatal(err)
	}
	h.republished("a released", 1, map[string]string{"gpu-7": "open", "gpu-6": "closing"})
	return h.closingSince("gpu-6")
}

// TestATaintFirstSeenLateIsWithdrawnAfterOneMoreGrace: when the plugin first
// sees its own withdrawal taint in the API some time after the taint's stamp
// (its echo waits for the publish interval), the grace counts from then,
// once: at the end of the grace the taint is stamped with that time, rounded
// up to the second (a stamp within a second of the old one the upstream
// slice controller would not write), which is that taint's own countdown,
// and the GPU is withdrawn a grace after it, not stamped again each grace
// for ever.
func TestATaintFirstSeenLateIsWithdrawnAfterOneMoreGrace(t *testing.T) {
	for _, late := range []time.Duration{2 * time.Second, 1300 * time.Millisecond} {
		t.Run(fmt.Sprintf("seen %v late", late), func(t *testing.T) {
			// Changes of what the node holds wait an hour: every
			// decision below is one the test makes (a health change)
			// or a grace's end.
			h, clk := startLazy(t, func(o *plugin.Options) { o.MIGPublishInterval = time.Hour })
			h.awaitLazy("empty node", map[string]string{"gpu-7": "open"})
			stamp := h.taintGPU6()
			clk.Step(late)
			h.republished("the taint seen", 2, map[string]string{"gpu-7": "open", "gpu-6": "closing"})
			clk.Step(lazyGrace - late)
			h.republished("a grace after the stamp, less than one after the sighting", 3, map[string]string{"gpu-7": "open", "gpu-6": "closing"})
			if got := h.closingSince("gpu-6"); got.Before(stamp.Add(late)) {
				t.Errorf("re-stamped %v, before the taint was first seen (%v)", got, stamp.Add(late))
			}
			// A grace after the sighting (rounded up): withdrawn, not
			// re-stamped for ever. Another decision seeing the API
			// before the re-stamp's echo may count once more: one more
			// grace is allowed, never an endless one.
			clk.Step(2*time.Second + time.Second - late%time.Second)
			h.awaitWithdrawn(clk, "a grace after the taint was first seen", map[string]string{"gpu-7": "open"})
		})
	}
}

// TestARestartRemembersWhenATaintWasFirstSeen: the plugin first sees its own
// withdrawal taint two seconds after its stamp, and restarts; the restarted
// plugin counts the grace from that first sighting (kept in its data
// directory), not from the stamp, so the GPU is withdrawn no earlier than a
// grace after the scheduler could have seen the taint.
func TestARestartRemembersWhenATaintWasFirstSeen(t *testing.T) {
	h, clk := startLazy(t, func(o *plugin.Options) { o.MIGPublishInterval = time.Hour })
	h.awaitLazy("empty node", map[string]string{"gpu-7": "open"})
	stamp := h.taintGPU6()
	clk.Step(2 * time.Second)
	h.republished("the taint seen, two seconds after its stamp", 2, map[string]string{"gpu-7": "open", "gpu-6": "closing"})

	h.restart()
	h.republished("after a restart", 3, map[string]string{"gpu-7": "open", "gpu-6": "closing"})
	if got := h.closingSince("gpu-6"); !got.Equal(stamp) {
		t.Fatalf("after a restart gpu-6 is closing since %v, want its stamp %v", got, stamp)
	}
	// A grace after the stamp, two seconds before a grace after the first
	// sighting: still tainted (the grace's end is decided on, by its
	// timer, before the next health change is published).
	clk.Step(lazyGrace - 2*time.Second)
	h.republished("a grace after the stamp, before one after the sighting", 4, map[string]string{"gpu-7": "open", "gpu-6": "closing"})
	clk.Step(2 * time.Second)
	h.awaitWithdrawn(clk, "a grace after the taint was first seen", map[string]string{"gpu-7": "open"})
}

// TestTurningLazyMIGOnCountsEveryPartitionAsPublished: a node whose plugin
// published every partition (LazyMIG off, or a release without it) and
// whose slices the kubelet then deleted, restarted with LazyMIG on, has no
// marker of lazy publishing; it still ran before, and the scheduler may hold
// allocations it made from any partition. Every free GPU's partitions are
// published again, tainted, and withdrawn only through the grace, not cut
// to the spare at once as on a node that never published.
func TestTurningLazyMIGOnCountsEveryPartitionAsPublished(t *testing.T) {
	h, clk := startLazy(t, func(o *plugin.Options) {
		o.FeatureGates = features.New()
		if err := o.FeatureGates.Set("LazyMIG=false"); err != nil {
			t.Fatal(err)
		}
	})
	h.awaitSlices("every partition published", func(m map[string][]string) bool { return len(m) == 8+8*partitionsPerH100 })
	h.plugin.Stop()
	_, sl := h.publishedTaints()
	for _, s := range sl {
		if err := h.client.ResourceV1().ResourceSlices().Delete(h.ctx, s.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	h.opts.FeatureGates = nil // the defaults: LazyMIG on
	h.restart()
	want := map[string]string{"gpu-7": "open"}
	for g := range 7 {
		want[fmt.Sprintf("gpu-%d", g)] = "closing"
	}
	h.awaitLazy("LazyMIG turned on", want)
	// The grace counts from when the plugin first sees its taints in the
	// API, which may be after this step: one more grace is allowed.
	clk.Step(lazyGrace)
	h.awaitWithdrawn(clk, "a grace later", map[string]string{"gpu-7": "open"})
}
