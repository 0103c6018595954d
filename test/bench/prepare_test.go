package bench

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/tessera-dev/tessera/cdi"
	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/plugin"
	"github.com/tessera-dev/tessera/test/cluster"
	"github.com/tessera-dev/tessera/test/kubeletsim"
)

// The plugin's default client rate limits (--kube-api-qps, --kube-api-burst).
const (
	defaultQPS   = 50
	defaultBurst = 100
)

// BenchmarkPrepare measures what a pod start and end cost the kubelet: a
// prepare and an unprepare of a one-GPU claim (gpu-0 of a DGX H100) over the
// plugin's real gRPC socket, the plugin fetching the claim from the real API
// server with its default rate limits. Two plugins serve two nodes side by
// side: one as a host process runs it, one as the chart runs it (--pod-uid
// set: the rolling-update mode, its state shared through the checkpoint on
// disk and file locks). In the same run, interleaved, it measures the floor:
// what any crash-safe driver must do for that claim, done alone and in
// sequence — one GET of the claim (own client, same limits), one checkpoint
// write and one CDI spec write of the very content the plugin wrote for it.
// Cycles are paced at 40 per second per node, under the default 50 qps, as a
// kubelet starting pods would be; only the calls are timed.
//
// Reported: p50 and p99 of prepare+unprepare (ms/p50, ms/p99; -rolling for
// the chart's mode), the floor's p50 (ms/floor-p50) and their ratios
// (x/floor, x/floor-rolling), each ratio with the cycles it summarises
// (-n) and the lowest and highest of the same ratio over each iteration's
// cycles alone (-lo, -hi).
func BenchmarkPrepare(b *testing.B) {
	c := controlPlane(b)
	ns := unique("bench-latency")
	n := startNode(b, c, ns, "dgx-h100", defaultQPS, defaultBurst, false)
	r := startNode(b, c, ns+"-r", "dgx-h100", defaultQPS, defaultBurst, true)
	ctx := benchContext(b)
	if err := c.CreateNamespace(ctx, ns); err != nil {
		b.Fatal(err)
	}
	claim, err := n.claim(ctx, c, ns, "one-gpu", "gpu-0")
	if err != nil {
		b.Fatal(err)
	}
	rclaim, err := r.claim(ctx, c, ns, "one-gpu-rolling", "gpu-0")
	if err != nil {
		b.Fatal(err)
	}
	floor := newFloor(b, n, claim)

	const cycles, pace = 200, 25 * time.Millisecond
	var full, rolling, base []time.Duration
	var batches, rbatches []float64 // each iteration's x/floor, x/floor-rolling
	// b.Loop, not b.N: the function runs once, exactly -benchtime's
	// iterations, where b.N would run it once more with one iteration first.
	for b.Loop() {
		from := len(full)
		for range cycles {
			next := time.Now().Add(pace)
			began := time.Now()
			if err := floor.run(ctx); err != nil {
				b.Fatal(err)
			}
			mid := time.Now()
			if err := n.cycle(ctx, claim); err != nil {
				b.Fatal(err)
			}
			plain := time.Now()
			if err := r.cycle(ctx, rclaim); err != nil {
				b.Fatal(err)
			}
			base = append(base, mid.Sub(began))
			full = append(full, plain.Sub(mid))
			rolling = append(rolling, time.Since(plain))
			time.Sleep(time.Until(next))
		}
		bf := percentile(base[from:], 50)
		batches = append(batches, float64(percentile(full[from:], 50))/float64(bf))
		rbatches = append(rbatches, float64(percentile(rolling[from:], 50))/float64(bf))
	}
	b.StopTimer()
	p50, p99, f50 := percentile(full, 50), percentile(full, 99), percentile(base, 50)
	r50, r99 := percentile(rolling, 50), percentile(rolling, 99)
	b.ReportMetric(ms(p50), "ms/p50")
	b.ReportMetric(ms(p99), "ms/p99")
	b.ReportMetric(ms(r50), "ms/p50-rolling")
	b.ReportMetric(ms(r99), "ms/p99-rolling")
	b.ReportMetric(ms(f50), "ms/floor-p50")
	// The ratios with how many cycles they summarise and their range over
	// the iterations (each the same ratio over its own cycles).
	reportSpread(b, float64(p50)/float64(f50), len(full), batches, "x/floor")
	reportSpread(b, float64(r50)/float64(f50), len(rolling), rbatches, "x/floor-rolling")
}

// floor is the least a crash-safe prepare of one claim does: read the claim,
// record it durably, write its CDI spec.
type floor struct {
	client   kubernetes.Interface
	claim    kubeletsim.Claim
	ckpt     *checkpoint.Store
	raw      []byte
	cdiStore *cdi.Store
	spec     cdi.ClaimSpec
}

// newFloor prepares the claim once through the plugin to capture the
// checkpoint and CDI spec it writes, unprepares it, and returns a floor that
// writes the same bytes into its own directories on the same file system.
func newFloor(b *testing.B, n *benchNode, claim kubeletsim.Claim) *floor {
	b.Helper()
	ctx := benchContext(b)
	if _, err := n.kubelet.Prepare(ctx, claim); err != nil {
		b.Fatal(err)
	}
	data, err := checkpoint.NewStore(n.opts.PluginDataDir)
	if err != nil {
		b.Fatal(err)
	}
	recorded, err := data.Load()
	if err != nil {
		b.Fatal(err)
	}
	specs, err := cdi.NewStore(n.opts.CDIRoot)
	if err != nil {
		b.Fatal(err)
	}
	written, err := specs.List()
	if err != nil || len(written) != 1 {
		b.Fatalf("want the claim's one CDI spec in %s, got %d: %v", n.opts.CDIRoot, len(written), err)
	}
	if _, err := n.kubelet.Unprepare(ctx, claim); err != nil {
		b.Fatal(err)
	}
	f := &floor{claim: claim, spec: written[0]}
	if f.raw, err = checkpoint.Encode(recorded); err != nil {
		b.Fatal(err)
	}
	if f.ckpt, err = checkpoint.NewStore(filepath.Join(n.dir, "floor", "plugin")); err != nil {
		b.Fatal(err)
	}
	// The floor's specs on the same file system as the plugin's.
	if f.cdiStore, err = cdi.NewStore(filepath.Join(n.opts.CDIRoot, "floor")); err != nil {
		b.Fatal(err)
	}
	// A client of its own, with the plugin's limits: its own token bucket.
	if f.client, err = plugin.NewClient(n.opts); err != nil {
		b.Fatal(err)
	}
	return f
}

func (f *floor) run(ctx context.Context) error {
	rc, err := f.client.ResourceV1().ResourceClaims(f.claim.Namespace).Get(ctx, f.claim.Name, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("floor: get claim: %w", err)
	}
	if rc.UID != f.claim.UID {
		return fmt.Errorf("floor: claim %s replaced", f.claim.Name)
	}
	if err := f.ckpt.Write(f.raw); err != nil {
		return fmt.Errorf("floor: %w", err)
	}
	if _, err := f.cdiStore.Write(f.spec); err != nil {
		return fmt.Errorf("floor: %w", err)
	}
	return nil
}

// BenchmarkPrepareThroughput measures claims prepared and unprepared per
// second over the real socket and API server by 1 caller and then by 16
// concurrent callers, in the same run, each caller with its own claims on
// its own hardware of a DGX H100 (whole GPUs 0-3 and 1g.10gb partitions of
// GPUs 4-7): independent claims should never wait for each other. It does
// so on two nodes in turn, in each iteration: one whose plugin runs as a
// host process, one whose plugin runs as the chart runs it (--pod-uid set:
// the rolling-update mode), whose figures carry the suffix -rolling. The
// plugins' client limits are raised (1000 qps) so that the figure is the
// plugin's own concurrency, not the token bucket: with the defaults a node
// sustains 50 prepares per second (--kube-api-qps).
//
// A third node, a host process with LazyMIG off (every partition published),
// runs the same claims in the same iterations: claims/s-c16-nolazy,
// plugin-cpu-ms/claim-c16-nolazy, and the default's ratios to it,
// x/nolazy-c16 and cpu-x/nolazy-c16 (goal at most 1.5):
// what lazy publishing costs the node's prepares.
//
// Reported, per mode: claims/s-c1, claims/s-c16 and speedup (their ratio),
// checkpoint writes and ResourceSlice writes per claim; for the host-process mode also the share
// of the machine's CPUs busy in each phase (cpu-busy-c1, cpu-busy-c16), CPU
// time per claim at 16 callers, and the share of the time spent writing the
// checkpoint in each phase.
func BenchmarkPrepareThroughput(b *testing.B) {
	c := controlPlane(b)
	ns := unique("bench-throughput")
	ctx := benchContext(b)
	if err := c.CreateNamespace(ctx, ns); err != nil {
		b.Fatal(err)
	}
	plain := newThroughputNode(b, c, ns, "", false)
	rolling := newThroughputNode(b, c, ns, "-r", true)
	nolazy := newThroughputNode(b, c, ns, "-nolazy", false, withGates(b, "LazyMIG=false"))
	plain.run(b, len(plain.claims)) // warm up: first MIG creations, connections
	rolling.run(b, len(rolling.claims))
	nolazy.run(b, len(nolazy.claims))
	var p, r, e throughput
	b.ResetTimer()
	for range b.N {
		p.add(plain.measure(b))
		r.add(rolling.measure(b))
		e.add(nolazy.measure(b))
	}
	b.StopTimer()
	N := float64(b.N)
	// What lazy MIG publishing (the default) costs this load: the same
	// claims on a node publishing every partition, in the same iterations.
	b.ReportMetric(e.c16/N, "claims/s-c16-nolazy")
	b.ReportMetric(e.own16/N, "plugin-cpu-ms/claim-c16-nolazy")
	b.ReportMetric(p.c16/e.c16, "x/nolazy-c16")
	b.ReportMetric(p.own16/e.own16, "cpu-x/nolazy-c16")
	b.ReportMetric(p.c1/N, "claims/s-c1")
	b.ReportMetric(p.c16/N, "claims/s-c16")
	b.ReportMetric(p.c16/p.c1, "speedup")
	b.ReportMetric(r.c1/N, "claims/s-c1-rolling")
	b.ReportMetric(r.c16/N, "claims/s-c16-rolling")
	b.ReportMetric(r.c16/r.c1, "speedup-rolling")
	// The whole machine's CPUs (plugin, API server, etcd, this caller) are
	// the other limit: near 1 at 16 callers, more callers cannot help.
	b.ReportMetric(p.busy1/N, "cpu-busy-c1")
	b.ReportMetric(p.busy16/N, "cpu-busy-c16")
	// What one claim's prepare and unprepare cost in CPU time at 16
	// callers: the whole machine's (plugin, API server, etcd, caller) and
	// this process's (the plugin and the simulated kubelet). Steadier than
	// claims/s on a shared machine, and what bounds c16 where CPUs are few.
	b.ReportMetric(p.cpu16/N, "cpu-ms/claim-c16")
	b.ReportMetric(p.own16/N, "plugin-cpu-ms/claim-c16")
	// Checkpoint writes (each with its fsync) per claim prepared and
	// unprepared: what the group commit saves when callers overlap.
	b.ReportMetric(p.writes1/N, "checkpoint-writes/claim-c1")
	b.ReportMetric(p.writes16/N, "checkpoint-writes/claim-c16")
	b.ReportMetric(r.writes1/N, "checkpoint-writes/claim-c1-rolling")
	b.ReportMetric(r.writes16/N, "checkpoint-writes/claim-c16-rolling")
	// ResourceSlice writes of the node's pool per claim prepared and
	// unprepared, over both phases (each write is the slice whole: tens of
	// kilobytes for the API server to store and send to every watcher).
	b.ReportMetric(p.sliceWrites/N, "slice-writes/claim")
	b.ReportMetric(r.sliceWrites/N, "slice-writes/claim-rolling")
	// The share of the phase the checkpoint writer spent writing: writes
	// are one at a time (one file), so near 1 the writer is the limit and
	// claims queue on each other's fsyncs, however many CPUs there are.
	b.ReportMetric(p.writer1/N, "checkpoint-busy-c1")
	b.ReportMetric(p.writer16/N, "checkpoint-busy-c16")
}

// throughputNode is one node of BenchmarkPrepareThroughput with its claims.
type throughputNode struct {
	n      *benchNode
	claims []kubeletsim.Claim
	// sliceWrites counts the writes of the node's ResourceSlices.
	sliceWrites *atomic.Int64
}

func newThroughputNode(b *testing.B, c *cluster.Cluster, ns, suffix string, rolling bool, adjust ...func(*plugin.Options)) *throughputNode {
	b.Helper()
	ctx := benchContext(b)
	n := startNode(b, c, ns+suffix, "dgx-h100", 1000, 1000, rolling, adjust...)
	devices := []string{"gpu-0", "gpu-1", "gpu-2", "gpu-3"}
	for g := 4; g < 8; g++ {
		for p := range 3 {
			devices = append(devices, fmt.Sprintf("gpu-%d-mig-1g10gb-%d", g, p))
		}
	}
	t := &throughputNode{n: n, claims: make([]kubeletsim.Claim, len(devices)), sliceWrites: countSliceWrites(b, n.name)}
	for i, d := range devices {
		var err error
		if t.claims[i], err = n.claim(ctx, c, ns, fmt.Sprintf("caller%s-%d", suffix, i), d); err != nil {
			b.Fatal(err)
		}
	}
	return t
}

// rounds is how often each caller cycles its own claim in a phase.
const rounds = 4

// run cycles the node's claims with callers concurrent callers and returns
// the claims prepared and unprepared per second.
func (t *throughputNode) run(b *testing.B, callers int) float64 {
	return cycleClaims(b, t.n, t.claims, callers)
}

// cycleClaims cycles claims on n with callers concurrent callers, each on
// its own claims (one caller alone takes every claim in turn: the same
// work), rounds times each, and returns the claims prepared and unprepared
// per second.
func cycleClaims(b *testing.B, n *benchNode, claims []kubeletsim.Claim, callers int) float64 {
	b.Helper()
	ctx := benchContext(b)
	var wg sync.WaitGroup
	errs := make([]error, callers)
	began := time.Now()
	for w := range callers {
		wg.Go(func() {
			for r := range rounds * len(claims) / callers {
				if err := n.cycle(ctx, claims[(w+r*callers)%len(claims)]); err != nil {
					errs[w] = err
					return
				}
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			b.Fatal(err)
		}
	}
	return float64(rounds*len(claims)) / time.Since(began).Seconds()
}

// throughput is what one iteration measured on one node (and their sums).
type throughput struct {
	c1, c16, busy1, busy16, cpu16, own16, writes1, writes16, writer1, writer16 float64
	// sliceWrites is ResourceSlice writes per claim over both phases.
	sliceWrites float64
}

func (t *throughput) add(o throughput) {
	t.c1 += o.c1
	t.c16 += o.c16
	t.busy1 += o.busy1
	t.busy16 += o.busy16
	t.cpu16 += o.cpu16
	t.own16 += o.own16
	t.writes1 += o.writes1
	t.writes16 += o.writes16
	t.writer1 += o.writer1
	t.writer16 += o.writer16
	t.sliceWrites += o.sliceWrites
}

// measure runs the one-caller phase, then the all-callers one.
func (t *throughputNode) measure(b *testing.B) throughput {
	b.Helper()
	before, beforeWrites, slices0 := readCPU(b), t.n.checkpointWrites(b), t.sliceWrites.Load()
	rate1 := t.run(b, 1)
	mid, midOwn, midWrites := readCPU(b), ownCPU(b), t.n.checkpointWrites(b)
	rate16 := t.run(b, len(t.claims))
	end, endOwn, endWrites := readCPU(b), ownCPU(b), t.n.checkpointWrites(b)
	cycles := float64(rounds * len(t.claims))
	settleWrites(b, t.sliceWrites)
	return throughput{
		sliceWrites: float64(t.sliceWrites.Load()-slices0) / (2 * cycles),
		c1:          rate1, c16: rate16,
		writes1:  (midWrites.n - beforeWrites.n) / cycles,
		writes16: (endWrites.n - midWrites.n) / cycles,
		// Writing time over the phase's wall time (cycles/rate).
		writer1:  (midWrites.seconds - beforeWrites.seconds) * rate1 / cycles,
		writer16: (endWrites.seconds - midWrites.seconds) * rate16 / cycles,
		busy1:    mid.busySince(before),
		busy16:   end.busySince(mid),
		cpu16:    end.busyMsSince(mid) / cycles,
		own16:    float64(endOwn-midOwn) / float64(time.Millisecond) / cycles,
	}
}

// ownCPU is the CPU time (user and system) this process has used.
func ownCPU(b *testing.B) time.Duration {
	b.Helper()
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// cpuTimes are the machine's CPU times from the first line of /proc/stat, in
// clock ticks.
type cpuTimes struct{ busy, total uint64 }

func readCPU(b *testing.B) cpuTimes {
	b.Helper()
	raw, err := os.ReadFile("/proc/stat")
	if err != nil {
		b.Fatal(err)
	}
	line, _, _ := strings.Cut(string(raw), "\n")
	fields := strings.Fields(line)
	if len(fields) < 5 || fields[0] != "cpu" {
		b.Fatalf("unexpected /proc/stat line %q", line)
	}
	var t cpuTimes
	for i, f := range fields[1:] {
		v, err := strconv.ParseUint(f, 10, 64)
		if err != nil {
			b.Fatalf("/proc/stat field %d %q: %v", i, f, err)
		}
		t.total += v
		// idle and iowait: a CPU waiting on the disk could do other work.
		if i != 3 && i != 4 {
			t.busy += v
		}
	}
	return t
}

// busyMsSince is the CPU time, in milliseconds, all CPUs were busy between
// earlier and t.
func (t cpuTimes) busyMsSince(earlier cpuTimes) float64 {
	return float64(t.busy-earlier.busy) * 1000 / float64(clockTicks)
}

// clockTicks is the unit of /proc/stat (USER_HZ), 100 on every Linux
// architecture Go supports.
const clockTicks = 100

// busySince is the share of all CPUs busy between earlier and t.
func (t cpuTimes) busySince(earlier cpuTimes) float64 {
	if t.total == earlier.total {
		return 0
	}
	return float64(t.busy-earlier.busy) / float64(t.total-earlier.total)
}

func percentile(ds []time.Duration, p int) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	i := (len(s)*p+99)/100 - 1
	return s[max(i, 0)]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// msAll converts durations to milliseconds.
func msAll(ds []time.Duration) []float64 {
	out := make([]float64, len(ds))
	for i, d := range ds {
		out[i] = ms(d)
	}
	return out
}

// median is the middle of vs (the mean of the two middle values for an even
// count).
func median(vs []float64) float64 {
	s := slices.Clone(vs)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// reportSamples reports the median of samples under unit, with how many
// (unit-n) and the lowest and highest (unit-lo, unit-hi): benchreport shows
// them as the figure's n and spread and judges a goal on enough samples.
func reportSamples(b *testing.B, samples []float64, unit string) {
	reportSpread(b, median(samples), len(samples), samples, unit)
}

// reportSpread reports value under unit with n samples behind it and the
// lowest and highest of estimates, its independent estimates (each sample,
// or each batch of samples).
func reportSpread(b *testing.B, value float64, n int, estimates []float64, unit string) {
	b.ReportMetric(value, unit)
	b.ReportMetric(float64(n), unit+"-n")
	b.ReportMetric(slices.Min(estimates), unit+"-lo")
	b.ReportMetric(slices.Max(estimates), unit+"-hi")
}
