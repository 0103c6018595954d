package slices_test

import (
	"context"
	"testing"
	"time"

	"github.com/tessera-dev/tessera/driver/inventory"
)

// BenchmarkAllocatorMIGVsPlain times the real allocator placing one claim on
// a DGX H100 published as whole GPUs and, in the same run, published with
// dynamic MIG (a 1g.10gb claim against 232 partitionable devices), and
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
