package bench

import (
	"bufio"
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

	"github.com/tessera-dev/tessera/deployments/rbac"
	"github.com/tessera-dev/tessera/test/gpunode"
)

// pluginBinaryEnv names a prebuilt cmd/tessera-kubelet-plugin (make bench
// passes _output/bin's); without it the benchmark builds one.
const pluginBinaryEnv = "TESSERA_PLUGIN_BINARY"

// BenchmarkPublish runs the real cmd/tessera-kubelet-plugin binary as its own
// process on a simulated DGX H100 (--fake-node dgx-h100, every gate at its
// default: dynamic MIG and device health on) against the real API server as
// its service account, and measures the time from starting the process to
// the API server holding the node's complete pool (every slice of its
// generation, seen through a watch), and the process's resident memory
// (VmRSS) right after. Each iteration is a fresh process and a fresh node.
//
// Reported: ms/publish, MiB/rss and its parts MiB/rss-anon and MiB/rss-file
// (means over the iterations).
func BenchmarkPublish(b *testing.B) {
	c := controlPlane(b)
	bin := pluginBinary(b)
	ctx := benchContext(b)
	kubeconfig, err := c.ServiceAccountKubeconfig(ctx, rbac.Namespace, rbac.KubeletPluginAccount)
	if err != nil {
		b.Fatal(err)
	}
	var took time.Duration
	var rss, anon, file float64
	b.ResetTimer()
	for range b.N {
		b.StopTimer()
		name := unique("bench-publish")
		if err := createNode(ctx, c, name); err != nil {
			b.Fatal(err)
		}
		dir, err := os.MkdirTemp("", "tb-pub-")
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = os.RemoveAll(dir) })
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
		cmd := exec.CommandContext(ctx, bin,
			"--fake-node=dgx-h100", "--node-name="+name, "--fake-root="+filepath.Join(dir, "host"),
			"--kubeconfig="+kubeconfig, "--cdi-root="+filepath.Join(dir, "cdi"),
			"--plugin-data-dir="+filepath.Join(dir, "plugin"), "--registrar-dir="+filepath.Join(dir, "reg"),
			"--boot-id-file="+bootID, "--metrics-address=127.0.0.1:0")
		log, err := os.Create(filepath.Join(dir, "plugin.log"))
		if err != nil {
			b.Fatal(err)
		}
		cmd.Stdout, cmd.Stderr = log, log
		b.StartTimer()
		began := time.Now()
		if err := cmd.Start(); err != nil {
			b.Fatalf("start %s: %v", bin, err)
		}
		werr := waitForPool(ctx, w, 30*time.Second)
		published := time.Since(began)
		b.StopTimer()
		w.Stop()
		mem, rerr := residentMiB(cmd.Process.Pid)
		_ = cmd.Process.Signal(syscall.SIGTERM)
		_ = cmd.Wait()
		_ = log.Close()
		if werr != nil || rerr != nil {
			out, _ := os.ReadFile(log.Name())
			b.Fatalf("node %s: %v %v\nplugin log:\n%s", name, werr, rerr, out)
		}
		took += published
		rss += mem.rss
		anon += mem.anon
		file += mem.file
	}
	b.ReportMetric(ms(took)/float64(b.N), "ms/publish")
	b.ReportMetric(rss/float64(b.N), "MiB/rss")
	// The two parts of it: the heap, stacks and runtime (anon), and the
	// binary's own pages mapped in (file: clean page cache, shared with
	// every other process running the binary). Kernels that cache the
	// binary in large folios map whole folios on a fault, so the file part
	// approaches the binary's loaded size however little of it runs.
	b.ReportMetric(anon/float64(b.N), "MiB/rss-anon")
	b.ReportMetric(file/float64(b.N), "MiB/rss-file")
}

// waitForPool returns once the watched slices hold one complete generation
// of the pool.
func waitForPool(ctx context.Context, w watch.Interface, timeout time.Duration) error {
	seen := map[string]*resourceapi.ResourceSlice{}
	deadline := time.After(timeout)
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-deadline:
			return fmt.Errorf("pool not complete within %v: %d slices seen", timeout, len(seen))
		case ev, ok := <-w.ResultChan():
			if !ok {
				return fmt.Errorf("watch of ResourceSlices ended")
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
				return nil
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
