package bench

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"

	"github.com/tessera-dev/tessera/component"
	"github.com/tessera-dev/tessera/deployments/rbac"
	"github.com/tessera-dev/tessera/test/cluster"
	"github.com/tessera-dev/tessera/test/gpunode"
	"github.com/tessera-dev/tessera/test/kubeletsim"
)

// pluginBinaryEnv names a prebuilt cmd/tessera-kubelet-plugin (make bench
// passes _output/bin's); without it the benchmark builds one.
const pluginBinaryEnv = "TESSERA_PLUGIN_BINARY"

// BenchmarkPublish runs the real cmd/tessera-kubelet-plugin binary as its own
// process on a simulated DGX H100 (--fake-node dgx-h100, every gate at its
// default: dynamic MIG and device health on) against the real API server as
// its service account, with a kubelet's side of the plugin registration
// (test/kubeletsim: GetInfo, then NotifyRegistrationStatus on the plugin's
// registration socket as soon as it appears, as the kubelet's plugin
// watcher does), and measures the time from starting the process to the
// API server holding the node's complete pool (every slice of its
// generation, seen through a watch), and the process's resident memory
// (VmRSS) right after. Each iteration is a fresh process and a fresh node.
//
// The plugin publishes a fresh node's devices only once the kubelet has
// registered it (or after plugin.DefaultRegistrationWait without a
// kubelet): an iteration in which the plugin fell back to publishing
// unregistered fails the benchmark, so the figure is always a publish after
// a registration. The kubelet's own delay is left out: its plugin manager
// registers a new socket on its next reconcile, up to a second later.
//
// After each sample, its timer stopped, it measures the floor of a publish
// on this machine at this moment (publishFloor: the binary started and
// exiting at once, and the very slices created by a client): the ratio of
// the two stays meaningful on a busy machine, where both slow down.
//
// Reported, each the median over the iterations with <unit>-n (how many)
// and <unit>-lo, <unit>-hi (the lowest and highest): ms/publish (start to
// published), ms/registered (start to the kubelet's NotifyRegistrationStatus
// answered), ms/publish-after-registration (registered to published),
// ms/publish-floor, x/publish-floor (each sample's publish over its floor)
// and MiB/rss; its parts MiB/rss-anon and MiB/rss-file as medians.
func BenchmarkPublish(b *testing.B) {
	c := controlPlane(b)
	bin := pluginBinary(b)
	ctx := benchContext(b)
	kubeconfig, err := c.ServiceAccountKubeconfig(ctx, rbac.Namespace, rbac.KubeletPluginAccount)
	if err != nil {
		b.Fatal(err)
	}
	cfg, err := component.RESTConfig(kubeconfig, defaultQPS, defaultBurst, "bench-publish-floor", time.Minute)
	if err != nil {
		b.Fatal(err)
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		b.Fatal(err)
	}
	var took, registered, after, floors []time.Duration
	var rss, anon, file, ratios []float64
	// b.Loop, not b.N: the function runs once, exactly -benchtime's
	// iterations, where b.N would run it once more with one iteration
	// first. b.Loop must be called with the timer running.
	for b.Loop() {
		b.StopTimer()
		s := publishOnce(b, c, bin, kubeconfig, client)
		floors = append(floors, s.floor)
		ratios = append(ratios, float64(s.published)/float64(s.floor))
		took = append(took, s.published)
		registered = append(registered, s.registered)
		after = append(after, s.published-s.registered)
		rss = append(rss, s.mem.rss)
		anon = append(anon, s.mem.anon)
		file = append(file, s.mem.file)
		b.StartTimer()
	}
	reportSamples(b, msAll(took), "ms/publish")
	reportSamples(b, msAll(registered), "ms/registered")
	reportSamples(b, msAll(after), "ms/publish-after-registration")
	reportSamples(b, msAll(floors), "ms/publish-floor")
	reportSamples(b, ratios, "x/publish-floor")
	reportSamples(b, rss, "MiB/rss")
	// The two parts of it: the heap, stacks and runtime (anon), and the
	// binary's own pages mapped in (file: clean page cache, shared with
	// every other process running the binary). Kernels that cache the
	// binary in large folios map whole folios on a fault, so the file part
	// approaches the binary's loaded size however little of it runs.
	b.ReportMetric(median(anon), "MiB/rss-anon")
	b.ReportMetric(median(file), "MiB/rss-file")
}

// publishSample is one start of the plugin: how long from the start until
// the kubelet's registration was answered and until the pool was complete
// in the API server, and the plugin's memory then.
type publishSample struct {
	registered, published time.Duration
	mem                   memory
	floor                 time.Duration // publishFloor's, right after
}

// fallbackMessage is what the plugin logs when it publishes without the
// kubelet's registration (driver/plugin's publish).
const fallbackMessage = "The kubelet has not registered the plugin yet"

// publishOnce starts the plugin binary for a fresh node with the timer
// running, registers it as the kubelet does, and waits for its pool; then,
// the timer stopped, it measures the floor (client: the plugin's service
// account).
func publishOnce(b *testing.B, c *cluster.Cluster, bin, kubeconfig string, client kubernetes.Interface) publishSample {
	b.Helper()
	ctx := benchContext(b)
	name := unique("bench-publish")
	if err := createNode(ctx, c, name); err != nil {
		b.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "tb-pub-") // short: unix socket paths
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = os.RemoveAll(dir) })
	// The kubelet owns and creates its registration directory.
	for _, d := range []string{"reg", "plugin"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o750); err != nil {
			b.Fatal(err)
		}
	}
	bootID := filepath.Join(dir, "boot_id")
	if err := os.WriteFile(bootID, []byte("5b0c2a4e-bench\n"), 0o644); err != nil {
		b.Fatal(err)
	}
	w, err := c.Client().ResourceV1().ResourceSlices().Watch(ctx, metav1.ListOptions{
		FieldSelector: "spec.driver=" + gpunode.DriverName + ",spec.nodeName=" + name,
	})
	if err != nil {
		b.Fatal(err)
	}
	defer w.Stop()
	cmd := exec.CommandContext(ctx, bin,
		"--fake-node=dgx-h100", "--node-name="+name, "--fake-root="+filepath.Join(dir, "host"),
		"--kubeconfig="+kubeconfig, "--cdi-root="+filepath.Join(dir, "cdi"),
		"--plugin-data-dir="+filepath.Join(dir, "plugin"), "--registrar-dir="+filepath.Join(dir, "reg"),
		"--boot-id-file="+bootID, "--metrics-address=127.0.0.1:0")
	log, err := os.Create(filepath.Join(dir, "plugin.log"))
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = log.Close() }()
	cmd.Stdout, cmd.Stderr = log, log
	type registration struct {
		at      time.Duration
		kubelet *kubeletsim.Kubelet
		err     error
	}
	regDone := make(chan registration, 1)
	b.StartTimer()
	began := time.Now()
	if err := cmd.Start(); err != nil {
		b.Fatalf("start %s: %v", bin, err)
	}
	go func() {
		regCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		k, err := kubeletsim.Register(regCtx, filepath.Join(dir, "reg"))
		regDone <- registration{at: time.Since(began), kubelet: k, err: err}
	}()
	pool, werr := waitForPool(ctx, w, 30*time.Second)
	published := time.Since(began)
	b.StopTimer()
	reg := <-regDone
	mem, rerr := residentMiB(cmd.Process.Pid)
	if reg.kubelet != nil {
		_ = reg.kubelet.Close()
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	_ = cmd.Wait()
	out, _ := os.ReadFile(log.Name())
	if werr != nil || rerr != nil || reg.err != nil {
		b.Fatalf("node %s: %v %v %v\nplugin log:\n%s", name, werr, rerr, reg.err, out)
	}
	if bytes.Contains(out, []byte(fallbackMessage)) {
		b.Fatalf("node %s: the plugin published without the kubelet's registration (registered after %v, published after %v): not the publish this benchmark measures\nplugin log:\n%s",
			name, reg.at, published, out)
	}
	return publishSample{registered: reg.at, published: published, mem: mem, floor: publishFloor(b, bin, client, pool)}
}

// publishFloor is the least any plugin does to publish a node, timed alone
// right after the plugin's sample: start a process of the same binary that
// exits at once (--help: the process's start, the Go runtime's and every
// package's initialisation, flag parsing), and create the very slices the
// plugin published, for another node, one after another as the plugin's
// service account.
func publishFloor(b *testing.B, bin string, client kubernetes.Interface, pool map[string]*resourceapi.ResourceSlice) time.Duration {
	b.Helper()
	ctx := benchContext(b)
	node := unique("bench-publish-floor")
	var copies []*resourceapi.ResourceSlice
	for _, s := range pool {
		c := &resourceapi.ResourceSlice{
			ObjectMeta: metav1.ObjectMeta{GenerateName: node + "-" + gpunode.DriverName + "-"},
			Spec:       *s.Spec.DeepCopy(),
		}
		c.Spec.NodeName, c.Spec.Pool.Name = &node, node
		copies = append(copies, c)
	}
	began := time.Now()
	// --help fails the flag parsing (exit status 1) after printing the
	// usage: the exit status says nothing here.
	_ = exec.CommandContext(ctx, bin, "--help").Run()
	for _, c := range copies {
		if _, err := client.ResourceV1().ResourceSlices().Create(ctx, c, metav1.CreateOptions{}); err != nil {
			b.Fatalf("floor: create a slice of %s: %v", node, err)
		}
	}
	return time.Since(began)
}

// waitForPool returns the watched slices once they hold one complete
// generation of the pool.
func waitForPool(ctx context.Context, w watch.Interface, timeout time.Duration) (map[string]*resourceapi.ResourceSlice, error) {
	seen := map[string]*resourceapi.ResourceSlice{}
	deadline := time.After(timeout)
	for {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-deadline:
			return nil, fmt.Errorf("pool not complete within %v: %d slices seen", timeout, len(seen))
		case ev, ok := <-w.ResultChan():
			if !ok {
				return nil, fmt.Errorf("watch of ResourceSlices ended")
			}
			s, isSlice := ev.Object.(*resourceapi.ResourceSlice)
			if !isSlice {
				continue
			}
			if ev.Type == watch.Deleted {
				delete(seen, s.Name)
			} else {
				seen[s.Name] = s
			}
			if complete(seen) {
				return seen, nil
			}
		}
	}
}

// complete says whether the slices hold every slice of their newest
// generation.
func complete(slices map[string]*resourceapi.ResourceSlice) bool {
	var gen, want, have int64
	for _, s := range slices {
		gen = max(gen, s.Spec.Pool.Generation)
	}
	for _, s := range slices {
		if s.Spec.Pool.Generation == gen {
			have++
			want = s.Spec.Pool.ResourceSliceCount
		}
	}
	return have > 0 && have == want
}

// memory is a process's resident set from /proc/<pid>/status, in MiB:
// VmRSS and its anonymous and file-backed parts (RssAnon, RssFile).
type memory struct{ rss, anon, file float64 }

func residentMiB(pid int) (memory, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return memory{}, err
	}
	defer func() { _ = f.Close() }()
	var m memory
	fields := map[string]*float64{"VmRSS:": &m.rss, "RssAnon:": &m.anon, "RssFile:": &m.file}
	found := 0
	s := bufio.NewScanner(f)
	for s.Scan() {
		key, rest, _ := strings.Cut(s.Text(), "\t")
		dst, ok := fields[key]
		if !ok {
			continue
		}
		kib, err := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 64)
		if err != nil {
			return memory{}, fmt.Errorf("parse %s %q: %w", key, rest, err)
		}
		*dst = kib / 1024
		found++
	}
	if found != len(fields) {
		return memory{}, fmt.Errorf("/proc/%d/status lacks one of VmRSS, RssAnon, RssFile", pid)
	}
	return m, nil
}

// pluginBinary returns $TESSERA_PLUGIN_BINARY or builds the plugin.
func pluginBinary(b *testing.B) string {
	b.Helper()
	if p := os.Getenv(pluginBinaryEnv); p != "" {
		return p
	}
	out := filepath.Join(b.TempDir(), "tessera-kubelet-plugin")
	// The tags the Makefile and the image build with (grpcnotrace: a third
	// of the binary and of its resident memory).
	build := exec.CommandContext(b.Context(), "go", "build", "-tags=grpcnotrace", "-o", out, "github.com/tessera-dev/tessera/cmd/tessera-kubelet-plugin")
	if msg, err := build.CombinedOutput(); err != nil {
		b.Fatalf("build the kubelet plugin (or set %s): %v\n%s", pluginBinaryEnv, err, msg)
	}
	return out
}
