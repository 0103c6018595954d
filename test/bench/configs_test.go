package bench

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/tessera-dev/tessera/driver/features"
	"github.com/tessera-dev/tessera/driver/plugin"
	"github.com/tessera-dev/tessera/test/kubeletsim"
)

// configuration is a set of the plugin's feature gates BenchmarkPrepareByConfiguration
// runs side by side: as shipped, and with each of the two dynamic-MIG gates off.
type configuration struct {
	name  string // the figures' suffix
	gates string // --feature-gates; empty: the defaults
}

var configurations = []configuration{
	{"shipped", ""},
	{"nolazy", "LazyMIG=false"},
	{"nodynamic", "DynamicMIG=false"},
}

// BenchmarkPrepareByConfiguration measures what the shipped configuration
// (DynamicMIG and LazyMIG on) costs a node's prepares against the same build
// with LazyMIG off and with DynamicMIG off: three plugins on three simulated
// DGX H100s against one real API server, each cycling (prepare, unprepare)
// claims of one whole GPU over its real socket, by 1 caller and then by 8
// concurrent callers (one per GPU), the configurations alternated within each
// iteration so that a busy machine weighs on all alike. Client limits are
// raised (1000 qps) as in BenchmarkPrepareThroughput.
//
// Reported per configuration: claims/s-c1-<config>, claims/s-c8-<config>,
// plugin-cpu-ms/claim-c1-<config> and -c8- (this process's CPU time: the
// plugin and the simulated kubelet; the other two plugins idle meanwhile),
// and slice-writes/claim-<config> (ResourceSlice creates, updates and
// deletes of the node's pool seen by a watch, over both phases); and the
// shipped configuration's ratios to DynamicMIG off: x/nodynamic-c8 (goal at
// least 0.8), x/nodynamic-c1, and cpu-x/nodynamic-c8 (goal at most 1.5).
func BenchmarkPrepareByConfiguration(b *testing.B) {
	c := controlPlane(b)
	ns := unique("bench-configs")
	ctx := benchContext(b)
	if err := c.CreateNamespace(ctx, ns); err != nil {
		b.Fatal(err)
	}
	nodes := make([]*configNode, len(configurations))
	for i, cfg := range configurations {
		nodes[i] = newConfigNode(b, ns, cfg)
	}
	for _, n := range nodes {
		n.run(b, len(n.claims)) // warm up: connections, first decisions
	}
	sums := make([]configFigures, len(nodes))
	b.ResetTimer()
	for range b.N {
		for i, n := range nodes {
			sums[i].add(n.measure(b))
		}
	}
	b.StopTimer()
	N := float64(b.N)
	for i, n := range nodes {
		f := sums[i]
		b.ReportMetric(f.c1/N, "claims/s-c1-"+n.cfg.name)
		b.ReportMetric(f.c8/N, "claims/s-c8-"+n.cfg.name)
		b.ReportMetric(f.cpu1/N, "plugin-cpu-ms/claim-c1-"+n.cfg.name)
		b.ReportMetric(f.cpu8/N, "plugin-cpu-ms/claim-c8-"+n.cfg.name)
		b.ReportMetric(f.writes/N, "slice-writes/claim-"+n.cfg.name)
	}
	shipped, nodynamic := sums[0], sums[2]
	b.ReportMetric(shipped.c1/nodynamic.c1, "x/nodynamic-c1")
	b.ReportMetric(shipped.c8/nodynamic.c8, "x/nodynamic-c8")
	b.ReportMetric(shipped.cpu8/nodynamic.cpu8, "cpu-x/nodynamic-c8")
}

// withGates sets the plugin's feature gates (--feature-gates); empty leaves
// the defaults.
func withGates(b *testing.B, gates string) func(*plugin.Options) {
	return func(o *plugin.Options) {
		if gates == "" {
			return
		}
		o.FeatureGates = features.New()
		if err := o.FeatureGates.Set(gates); err != nil {
			b.Fatal(err)
		}
	}
}

// configNode is one configuration's node with a claim per whole GPU, and a
// count of its pool's slice writes.
type configNode struct {
	cfg    configuration
	n      *benchNode
	claims []kubeletsim.Claim
	writes *atomic.Int64
}

func newConfigNode(b *testing.B, ns string, cfg configuration) *configNode {
	b.Helper()
	c := controlPlane(b)
	ctx := benchContext(b)
	name := ns + "-" + cfg.name
	n := startNode(b, c, name, "dgx-h100", 1000, 1000, false, withGates(b, cfg.gates))
	t := &configNode{cfg: cfg, n: n}
	for g := range 8 {
		claim, err := n.claim(ctx, c, ns, fmt.Sprintf("%s-%d", cfg.name, g), fmt.Sprintf("gpu-%d", g))
		if err != nil {
			b.Fatal(err)
		}
		t.claims = append(t.claims, claim)
	}
	t.writes = countSliceWrites(b, name)
	return t
}

// countSliceWrites counts the writes (creates, updates, deletes) of the
// node's ResourceSlices from now on, as a watch sees them.
func countSliceWrites(b *testing.B, node string) *atomic.Int64 {
	b.Helper()
	w, err := controlPlane(b).Client().ResourceV1().ResourceSlices().Watch(benchContext(b), metav1.ListOptions{FieldSelector: "spec.nodeName=" + node})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(w.Stop)
	var n atomic.Int64
	go func() {
		for ev := range w.ResultChan() {
			switch ev.Type {
			case watch.Added, watch.Modified, watch.Deleted:
				n.Add(1)
			}
		}
	}()
	return &n
}

// settleWrites waits until writes has not moved for a second, at most 30 s,
// so that the writes a phase caused (one the last unprepare causes lands
// after it returns) are counted in it.
func settleWrites(b *testing.B, writes *atomic.Int64) {
	b.Helper()
	ctx, cancel := context.WithTimeout(benchContext(b), 30*time.Second)
	defer cancel()
	last := writes.Load()
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Second):
		}
		now := writes.Load()
		if now == last {
			return
		}
		last = now
	}
}

// run cycles the node's claims with callers concurrent callers, each on its
// own GPUs, and returns the claims prepared and unprepared per second.
func (t *configNode) run(b *testing.B, callers int) float64 {
	return cycleClaims(b, t.n, t.claims, callers)
}

// configFigures are what one iteration measured on one node, and their sums.
type configFigures struct{ c1, c8, cpu1, cpu8, writes float64 }

func (f *configFigures) add(o configFigures) {
	f.c1 += o.c1
	f.c8 += o.c8
	f.cpu1 += o.cpu1
	f.cpu8 += o.cpu8
	f.writes += o.writes
}

// measure runs the one-caller phase, then the eight-caller one. The slice
// writes are counted once the node has settled after both: a write the
// last unprepare causes lands after it returns.
func (t *configNode) measure(b *testing.B) configFigures {
	b.Helper()
	cycles := float64(rounds * len(t.claims))
	writes0, cpu0 := t.writes.Load(), ownCPU(b)
	rate1 := t.run(b, 1)
	cpu1 := ownCPU(b)
	rate8 := t.run(b, len(t.claims))
	cpu8 := ownCPU(b)
	settleWrites(b, t.writes)
	return configFigures{
		c1: rate1, c8: rate8,
		cpu1:   float64(cpu1-cpu0) / float64(time.Millisecond) / cycles,
		cpu8:   float64(cpu8-cpu1) / float64(time.Millisecond) / cycles,
		writes: float64(t.writes.Load()-writes0) / (2 * cycles),
	}
}
