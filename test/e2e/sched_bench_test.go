package e2e

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"

	"github.com/tessera-dev/tessera/driver/discovery"
	"github.com/tessera-dev/tessera/driver/inventory"
	"github.com/tessera-dev/tessera/driver/sharing"
	"github.com/tessera-dev/tessera/test/cluster"
	"github.com/tessera-dev/tessera/test/fixtures"
	"github.com/tessera-dev/tessera/test/gpunode"
)

// schedCase is one way nodes publish their GPUs and pods ask for them.
type schedCase struct {
	name string
	// layout is what the kubelet plugin's flags and gates make of the
	// node's GPUs (inventory.Options as driver/plugin builds them).
	layout func(b testing.TB) inventory.Options
	// class, selector and capacity make each pod's claim: one device.
	class    string
	selector string
	capacity map[resourceapi.QualifiedName]resource.Quantity
	// lazy: the nodes publish lazily (the LazyMIG gate, on by default):
	// first as a node that holds nothing (fixtures.PublishedLazily), then
	// again each time the scheduler allocates on them (republishLazily).
	lazy bool
	// shape, when set, rearranges what each node publishes: a layout the
	// plugin does not ship, measured as a lever (sched_shapes_test.go).
	shape func(testing.TB, []*resourceapi.ResourceSlice) []*resourceapi.ResourceSlice
}

// schedCases are the cases of BenchmarkSchedulerThroughput; whole comes first
// so that the others are reported as a ratio to it.
var schedCases = []schedCase{
	// DynamicMIG off: every GPU is one whole device.
	{name: "whole", layout: func(testing.TB) inventory.Options { return inventory.Options{} }, class: gpuClass},
	// DynamicMIG on (its default) with LazyMIG off: every profile at every
	// placement, and the whole GPU, drawing on the GPU's counter set.
	{name: "mig1g", layout: dynamicMIG, class: migClass, selector: mig1gSelector},
	{name: "migwhole", layout: dynamicMIG, class: gpuClass},
	// --time-sliced-gpus=all=4: each GPU is one device four claims share.
	{name: "timeslice", layout: sharedBy(func(p *sharing.Policy) error { return p.ParseTimeSliced("all=4") }), class: "timeslice.gpu.tessera.dev"},
	// --memory-shared-gpus=all: claims take 16 GiB each (four per H100).
	{name: "memshare", layout: sharedBy(func(p *sharing.Policy) error { return p.ParseMemoryShared("all") }), class: "memory.gpu.tessera.dev",
		capacity: map[resourceapi.QualifiedName]resource.Quantity{"memory": resource.MustParse("16Gi")}},
	// DynamicMIG and LazyMIG on (their defaults): each node publishes its
	// whole GPUs, its counter sets and one spare GPU's partitions, and is
	// republished as the scheduler allocates on it.
	{name: "lazy1g", layout: dynamicMIG, lazy: true, class: migClass, selector: mig1gSelector},
	{name: "lazywhole", layout: dynamicMIG, lazy: true, class: gpuClass},
	// A lever (a shape the plugin does not publish), with both kinds of pod
	// of the dynamic-MIG cases: aligned1g and alignedwhole keep each GPU's
	// devices in one slice (one write per health change).
	{name: "aligned1g", layout: dynamicMIG, shape: alignedShape, class: migClass, selector: mig1gSelector},
	{name: "alignedwhole", layout: dynamicMIG, shape: alignedShape, class: gpuClass},
}

const mig1gSelector = `device.attributes["gpu.tessera.dev"].profile == "1g.10gb"`

func dynamicMIG(testing.TB) inventory.Options { return inventory.Options{DynamicMIG: true} }

// sharedBy is the layout of a plugin whose sharing flags parse as set does.
func sharedBy(set func(*sharing.Policy) error) func(testing.TB) inventory.Options {
	return func(b testing.TB) inventory.Options {
		var p sharing.Policy
		if err := set(&p); err != nil {
			b.Fatal(err)
		}
		return inventory.Options{Sharing: p.For}
	}
}

// schedNodeCounts are the cluster sizes BenchmarkSchedulerThroughput runs, with
// the pods each case creates: enough that the steady rate dominates the
// start, few enough that make bench stays within minutes on two cores.
var schedNodeCounts = []struct{ nodes, pods int }{{100, 600}, {500, 400}, {1000, 400}}

// schedulerAPIQPS is the scheduler's client rate limit in the benchmark:
// far above what it reaches, so that no case is paced by the limiter.
const schedulerAPIQPS = 5000

// BenchmarkSchedulerThroughput measures the real kube-scheduler (v1.37.2, of
// the local cluster, client rate limit 5,000 qps) placing pods that each ask
// for one device through a claim of their own, on simulated DGX H100 nodes
// (Ready Node objects without kubelets, their slices exactly as the kubelet
// plugin builds them, published through the API). For each node count and
// case, on a fresh cluster: the claims are created first, then the pods as
// fast as the apiserver takes them, and it reports pods/s (first pod created
// to last bound), the scheduler's CPU time per pod (/proc/<pid>/stat), p50
// and p99 of each pod's creation to its binding as the benchmark's watch sees
// it, the scheduler's mean scheduling-algorithm time per pod (its metrics),
// and x/whole, each case's pods/s over the whole case's in the same run.
//
// Cases (schedCases): whole GPUs with DynamicMIG off; dynamic MIG with pods
// asking for a 1g.10gb and for a whole GPU, every partition published
// (LazyMIG off) and lazily (as shipped, each node republished as the
// scheduler allocates on it, as its plugin would after the prepare); GPUs
// time-sliced four ways; GPUs shared by
// memory, 16 GiB a claim; and a lever, a dynamic-MIG shape the plugin does
// not publish (sched_shapes_test.go), with both kinds of pod.
// Sizes: 100, 500 and 1,000 nodes (make bench runs 100 and 500; SCHED_BENCH
// chooses). TESSERA_SCHED_PROFILE=<dir>
// also writes a 20-second CPU profile of the scheduler per case into dir.
func BenchmarkSchedulerThroughput(b *testing.B) {
	for _, size := range schedNodeCounts {
		b.Run(fmt.Sprintf("nodes=%d", size.nodes), func(b *testing.B) {
			gpus := discoverSimNodes(b, size.nodes)
			var whole float64
			for _, sc := range schedCases {
				b.Run("case="+sc.name, func(b *testing.B) {
					var r schedResult
					for range b.N {
						r = runSchedCase(b, sc, gpus, size.pods)
					}
					b.ReportMetric(r.podsPerSecond, "pods/s")
					b.ReportMetric(r.cpuPerPod.Seconds()*1000, "cpu-ms/pod")
					b.ReportMetric(r.p50.Seconds()*1000, "ms/p50")
					b.ReportMetric(r.p99.Seconds()*1000, "ms/p99")
					b.ReportMetric(r.algorithmPerPod.Seconds()*1000, "ms/algorithm")
					if sc.name == "whole" {
						whole = r.podsPerSecond
					} else if whole > 0 {
						b.ReportMetric(r.podsPerSecond/whole, "x/whole")
					}
				})
			}
		})
	}
}

// discoverSimNodes discovers the GPUs of n simulated DGX H100 nodes, named
// simNodeName(i) (their GPU UUIDs derive from the name), once for every case.
func discoverSimNodes(b testing.TB, n int) [][]discovery.GPU {
	b.Helper()
	p := fixtures.Profile(b, "dgx-h100")
	out := make([][]discovery.GPU, n)
	for i := range out {
		_, out[i] = fixtures.Node(b, p, simNodeName(i))
	}
	return out
}

// schedResult is what one case measured.
type schedResult struct {
	podsPerSecond   float64
	cpuPerPod       time.Duration
	p50, p99        time.Duration
	algorithmPerPod time.Duration
}

func runSchedCase(b *testing.B, sc schedCase, gpus [][]discovery.GPU, pods int) schedResult {
	b.StopTimer()
	c := cluster.StartT(b, cluster.Options{SchedulerAPIQPS: schedulerAPIQPS, SchedulerAPIBurst: 2 * schedulerAPIQPS})
	ctx, cancel := context.WithTimeout(b.Context(), 20*time.Minute)
	defer cancel()
	if err := gpunode.Install(ctx, c); err != nil {
		b.Fatal(err)
	}
	// The benchmark's own client must not be what sets the pace either.
	cfg := c.RESTConfig()
	cfg.QPS, cfg.Burst = 5000, 10000
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		b.Fatal(err)
	}
	layout := sc.layout(b)
	published := make([][]*resourceapi.ResourceSlice, len(gpus))
	for i := range gpus {
		if sc.lazy {
			published[i] = fixtures.PublishedLazily(b, simNodeName(i), gpus[i], layout)
		} else {
			published[i] = fixtures.Published(b, simNodeName(i), gpus[i], layout)
		}
		if sc.shape != nil {
			published[i] = sc.shape(b, published[i])
		}
	}
	began := time.Now()
	stopLeases := simulateNodes(ctx, b, client, published)
	defer stopLeases()
	b.Logf("%d nodes published in %v", len(gpus), time.Since(began).Round(time.Millisecond))

	const ns = "bench"
	if err := c.CreateNamespace(ctx, ns); err != nil {
		b.Fatal(err)
	}
	names := make([]string, pods)
	for i := range names {
		names[i] = fmt.Sprintf("p-%d", i)
	}
	noErr(b, parallel(names, func(name string) error {
		return ok(client.ResourceV1().ResourceClaims(ns).Create(ctx, benchClaim(ns, name, sc), metav1.CreateOptions{}))
	}))
	stopRepublishing := func() int { return 0 }
	if sc.lazy {
		stopRepublishing = republishLazily(ctx, b, client, ns, gpus, layout)
	}

	w := watchBindings(ctx, b, client, ns)
	algBefore := schedulerHistogram(ctx, b, c, "scheduler_scheduling_algorithm_duration_seconds")
	cpuBefore, err := c.SchedulerCPU()
	noErr(b, err)
	profiled := profileScheduler(ctx, c, sc.name, len(gpus))
	defer func() { _ = profiled() }()

	b.StartTimer()
	first := time.Now()
	noErr(b, parallel(names, func(name string) error {
		pod := newGPUPod(ns, name, corev1.PodResourceClaim{Name: "gpu", ResourceClaimName: ptr.To(name)})
		w.created(name, time.Now())
		return ok(client.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}))
	}))
	latencies, last, err := w.wait(ctx, names, 10*time.Minute)
	b.StopTimer()
	if err != nil {
		b.Fatal(err)
	}
	if n := stopRepublishing(); sc.lazy {
		b.Logf("the nodes republished their devices %d times as the scheduler allocated", n)
	}
	cpuAfter, err := c.SchedulerCPU()
	noErr(b, err)
	algAfter := schedulerHistogram(ctx, b, c, "scheduler_scheduling_algorithm_duration_seconds")
	noErr(b, profiled())

	reportThrottling(ctx, b, c)
	slices.Sort(latencies)
	r := schedResult{
		podsPerSecond: float64(pods) / last.Sub(first).Seconds(),
		cpuPerPod:     (cpuAfter - cpuBefore) / time.Duration(pods),
		p50:           latencies[len(latencies)/2],
		p99:           latencies[(len(latencies)*99)/100],
	}
	if n := algAfter.count - algBefore.count; n > 0 {
		r.algorithmPerPod = time.Duration((algAfter.sum - algBefore.sum) / n * float64(time.Second))
	}
	b.Logf("%s on %d nodes: %d pods bound in %v: %.1f pods/s, scheduler CPU %v (%.1f ms/pod), p50 %v, p99 %v, algorithm %v/pod over %.0f attempts",
		sc.name, len(gpus), pods, last.Sub(first).Round(time.Millisecond), r.podsPerSecond, (cpuAfter - cpuBefore),
		r.cpuPerPod.Seconds()*1000, r.p50.Round(time.Millisecond), r.p99.Round(time.Millisecond), r.algorithmPerPod.Round(time.Microsecond),
		algAfter.count-algBefore.count)
	return r
}

// benchClaim is a pod's own claim for one device of the case.
func benchClaim(ns, name string, sc schedCase) *resourceapi.ResourceClaim {
	req := &resourceapi.ExactDeviceRequest{DeviceClassName: sc.class}
	if sc.selector != "" {
		req.Selectors = []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: sc.selector}}}
	}
	if sc.capacity != nil {
		req.Capacity = &resourceapi.CapacityRequirements{Requests: sc.capacity}
	}
	return &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec:       resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: req}}}},
	}
}

// parallel runs do for every name with a few workers, as a burst of clients
// would, and returns every error.
func parallel(names []string, do func(string) error) error {
	errs := make([]error, len(names))
	eachIndex(len(names), 16, func(i int) { errs[i] = do(names[i]) })
	return errors.Join(errs...)
}

// bindings records when each pod was created and when the benchmark's
// informer first saw it bound to a node.
type bindings struct {
	mu                 sync.Mutex
	createdAt, boundAt map[string]time.Time
	changed            chan struct{}
}

func watchBindings(ctx context.Context, b *testing.B, client kubernetes.Interface, ns string) *bindings {
	b.Helper()
	w := &bindings{createdAt: map[string]time.Time{}, boundAt: map[string]time.Time{}, changed: make(chan struct{}, 1)}
	factory := informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithNamespace(ns))
	informer := factory.Core().V1().Pods().Informer()
	seen := func(obj any) {
		pod, isPod := obj.(*corev1.Pod)
		if !isPod || pod.Spec.NodeName == "" {
			return
		}
		now := time.Now()
		w.mu.Lock()
		if _, known := w.boundAt[pod.Name]; !known {
			w.boundAt[pod.Name] = now
		}
		w.mu.Unlock()
		select {
		case w.changed <- struct{}{}:
		default:
		}
	}
	_, err := informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    seen,
		UpdateFunc: func(_, obj any) { seen(obj) },
	})
	noErr(b, err)
	factory.Start(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), informer.HasSynced) {
		b.Fatal("pod informer did not sync")
	}
	b.Cleanup(factory.Shutdown)
	return w
}

func (w *bindings) created(name string, at time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.createdAt[name] = at
}

// wait waits until every pod is bound and returns each one's creation to
// binding time and when the last was bound.
func (w *bindings) wait(ctx context.Context, names []string, timeout time.Duration) ([]time.Duration, time.Time, error) {
	deadline := time.After(timeout)
	for {
		w.mu.Lock()
		bound := len(w.boundAt)
		w.mu.Unlock()
		if bound == len(names) {
			break
		}
		select {
		case <-w.changed:
		case <-deadline:
			return nil, time.Time{}, fmt.Errorf("%d of %d pods bound after %v", bound, len(names), timeout)
		case <-ctx.Done():
			return nil, time.Time{}, fmt.Errorf("%d of %d pods bound: %w", bound, len(names), ctx.Err())
		}
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	var last time.Time
	out := make([]time.Duration, 0, len(names))
	for _, name := range names {
		at := w.boundAt[name]
		out = append(out, at.Sub(w.createdAt[name]))
		if at.After(last) {
			last = at
		}
	}
	return out, last, nil
}

// histogram is a Prometheus histogram's sum and count.
type histogram struct{ sum, count float64 }

// schedulerHistogram sums a histogram of the scheduler's /metrics over all
// its label sets.
func schedulerHistogram(ctx context.Context, b *testing.B, c *cluster.Cluster, name string) histogram {
	b.Helper()
	body, err := c.SchedulerGet(ctx, "/metrics")
	noErr(b, err)
	var h histogram
	s := bufio.NewScanner(bytes.NewReader(body))
	s.Buffer(nil, 1<<20)
	for s.Scan() {
		line := s.Text()
		series, value, found := strings.Cut(line, " ")
		if !found {
			continue
		}
		metric, _, _ := strings.Cut(series, "{")
		v, err := strconv.ParseFloat(strings.TrimSpace(value), 64)
		if err != nil {
			continue
		}
		switch metric {
		case name + "_sum":
			h.sum += v
		case name + "_count":
			h.count += v
		}
	}
	return h
}

// reportThrottling logs how long the scheduler's requests waited for its
// client-side rate limiter, and any "client-side throttling" lines in its
// log: either means the limiter, not the scheduler, set the pace.
func reportThrottling(ctx context.Context, b *testing.B, c *cluster.Cluster) {
	b.Helper()
	wait := schedulerHistogram(ctx, b, c, "rest_client_rate_limiter_duration_seconds")
	log, err := os.ReadFile(c.SchedulerLog())
	noErr(b, err)
	lines := strings.Count(string(log), "client-side throttling")
	b.Logf("scheduler rate limiter: %.0f requests waited %.3f s in all; %d client-side throttling lines in its log", wait.count, wait.sum, lines)
	b.ReportMetric(float64(lines), "throttling-lines")
}

// profileScheduler fetches a 20-second CPU profile of the scheduler into
// $TESSERA_SCHED_PROFILE/<case>-<nodes>.pprof when that is set; the returned
// wait blocks until it is written (at once when not profiling) and says
// whether that failed. Call it on every path: the fetch must not outlive the
// benchmark.
func profileScheduler(ctx context.Context, c *cluster.Cluster, name string, nodes int) (wait func() error) {
	dir := os.Getenv("TESSERA_SCHED_PROFILE")
	if dir == "" {
		return func() error { return nil }
	}
	result := make(chan error, 1)
	go func() {
		body, err := c.SchedulerGet(ctx, "/debug/pprof/profile?seconds=20")
		if err == nil {
			err = os.WriteFile(filepath.Join(dir, fmt.Sprintf("%s-%d.pprof", name, nodes)), body, 0o644)
		}
		if err != nil {
			err = fmt.Errorf("profile the scheduler: %w", err)
		}
		result <- err
	}()
	var once sync.Once
	var err error
	return func() error {
		once.Do(func() { err = <-result })
		return err
	}
}
