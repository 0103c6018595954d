package slices_test

import (
	"context"
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/utils/ptr"

	"github.com/tessera-dev/tessera/deviceclass"
	"github.com/tessera-dev/tessera/driver/inventory"
	"github.com/tessera-dev/tessera/driver/simulate"
)

// BenchmarkAllocatorMIGVsPlain times the real allocator placing one claim on
// a DGX H100 published as whole GPUs and, in the same run, published with
// dynamic MIG (a 1g.10gb claim against 208 partitionable devices), and
// reports both and their ratio (plain/mig: 1 means MIG costs nothing extra).
func BenchmarkAllocatorMIGVsPlain(b *testing.B) {
	t := &testing.T{}
	plain := cluster(t, profile(t, "dgx-h100"))
	migc, _ := migCluster(t, profile(t, "dgx-h100"), inventory.Pack)
	if t.Failed() {
		b.Fatal("setup failed")
	}
	ctx := context.Background()
	var plainDur, migDur time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		start := time.Now()
		if res, err := plain.Allocate(ctx, node, claim(request{count: 1})); err != nil || res == nil {
			b.Fatalf("plain: %v %v", res, err)
		}
		mid := time.Now()
		if res, err := migc.Allocate(ctx, node, profileClaim("1g.10gb")); err != nil || res == nil {
			b.Fatalf("mig: %v %v", res, err)
		}
		plainDur += mid.Sub(start)
		migDur += time.Since(mid)
	}
	p := float64(plainDur.Microseconds()) / float64(b.N)
	m := float64(migDur.Microseconds()) / float64(b.N)
	b.ReportMetric(p, "us/plain-claim")
	b.ReportMetric(m, "us/mig-claim")
	b.ReportMetric(p/m, "plain/mig")
}

// BenchmarkAllocator500Nodes times the real allocator placing a 1g.10gb
// claim on one node of a cluster of 500 DGX H100s, each published with
// dynamic MIG (2,500 slices, 104,000 devices: 208 a node): one allocator built over every
// slice, as the scheduler builds one per pod, then one node tried, as its
// Filter does per node. Reported as us/claim.
func BenchmarkAllocator500Nodes(b *testing.B) {
	const nodes = 500
	t := &testing.T{}
	one := publishedWith(t, profile(t, "dgx-h100"), true, inventory.Pack)
	classes, err := deviceclass.All()
	if err != nil || t.Failed() {
		b.Fatalf("setup failed: %v", err)
	}
	var all []*resourceapi.ResourceSlice
	for i := range nodes {
		all = append(all, renamed(one, fmt.Sprintf("node-%d", i))...)
	}
	c := simulate.New(classes, all)
	target := fmt.Sprintf("node-%d", nodes/2)
	ctx := context.Background()
	runtime.GC() // the copies above are garbage: not this loop's to collect
	b.ResetTimer()
	for range b.N {
		if res, err := c.Allocate(ctx, target, profileClaim("1g.10gb")); err != nil || res == nil {
			b.Fatalf("allocate on %s: %v %v", target, res, err)
		}
	}
	b.StopTimer()
	b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N), "us/claim")
}

// renamed copies a node's slices (published for `node`) as another node's.
func renamed(sl []*resourceapi.ResourceSlice, nodeName string) []*resourceapi.ResourceSlice {
	out := make([]*resourceapi.ResourceSlice, 0, len(sl))
	for _, s := range sl {
		c := s.DeepCopy()
		c.Name = strings.Replace(s.Name, node, nodeName, 1)
		c.Spec.NodeName = ptr.To(nodeName)
		c.Spec.Pool.Name = nodeName
		out = append(out, c)
	}
	return out
}
