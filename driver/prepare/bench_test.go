package prepare_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"
)

// BenchmarkPrepareConcurrency prepares and unprepares one-device claims on a
// DGX H100 (whole GPUs and MIG partitions, each caller its own hardware) with
// 1 and then 16 concurrent callers in the same run, and reports claims per
// second for both and the speed-up: what checkpoint batching and per-claim
// locks buy.
func BenchmarkPrepareConcurrency(b *testing.B) {
	t := &testing.T{}
	e := newEnv(t, "dgx-h100")
	m := e.start()
	devices := []string{}
	for g := range 8 {
		devices = append(devices, fmt.Sprintf("gpu-%d-mig-1g10gb-0", g), fmt.Sprintf("gpu-%d-mig-1g10gb-1", g))
	}
	ctx := context.Background()
	run := func(callers, perCaller int) float64 {
		start := time.Now()
		var wg sync.WaitGroup
		for w := range callers {
			wg.Go(func() {
				for i := range perCaller {
					c := claim(fmt.Sprintf("w%d-%d", w, i), devices[w])
					if _, err := m.Prepare(ctx, c); err != nil {
						b.Error(err)
						return
					}
					if err := m.Unprepare(ctx, c.UID); err != nil {
						b.Error(err)
						return
					}
				}
			})
		}
		wg.Wait()
		return float64(callers*perCaller) / time.Since(start).Seconds()
	}
	b.ResetTimer()
	var c1, c16 float64
	for range b.N {
		c1 += run(1, 16)
		c16 += run(16, 16)
	}
	b.ReportMetric(c1/float64(b.N), "claims/s-c1")
	b.ReportMetric(c16/float64(b.N), "claims/s-c16")
	b.ReportMetric(c16/c1, "speedup")
}
