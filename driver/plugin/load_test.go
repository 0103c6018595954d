package plugin_test

import (
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/inventory"
)

// TestPrepareUnderLoadNeverDoubleHoldsHardware runs 1,000 prepare/unprepare
// cycles from 32 concurrent callers over the real socket, on whole GPUs and
// MIG partitions of one DGX H100 that deliberately collide, and checks that
// no piece of hardware is ever held by two claims and nothing leaks (claims,
// CDI specs, MIG instances).
func TestPrepareUnderLoadNeverDoubleHoldsHardware(t *testing.T) {
	h, n := startOnFakeNode(t, "dgx-h100", nil)
	inv := h.plugin.Manager().Inventory()
	// Whole GPUs and two profiles of partitions: claims collide, by name,
	// by placement, and whole against partition.
	var pool []string
	for _, d := range inv.Devices {
		if d.Name == d.GPU.Name() || d.Profile.Name == "1g.10gb" || d.Profile.Name == "3g.40gb" {
			pool = append(pool, d.Name)
		}
	}
	const callers, cycles = 32, 1000
	var (
		mu        sync.Mutex
		held      = map[string]string{} // device -> claim
		latencies []time.Duration
		refused   int
		errs      []string
		// releasing are claims whose unprepare was sent: the plugin may
		// free their hardware before the caller hears back, so a prepare
		// overlapping them is no proof of double holding.
		releasing = map[string]bool{}
	)
	overlaps := func(dev string) string {
		want, _ := inv.Lookup(dev)
		for other, c := range held {
			o, _ := inv.Lookup(other)
			if (other == dev || overlapOf(want, o)) && !releasing[c] {
				return c
			}
		}
		return ""
	}
	var next int
	var wg sync.WaitGroup
	for w := range callers {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(w), 7))
			for {
				mu.Lock()
				if next >= cycles {
					mu.Unlock()
					return
				}
				i := next
				next++
				mu.Unlock()
				dev := pool[r.IntN(len(pool))]
				c := h.claim(fmt.Sprintf("load-%d", i), dev)
				start := time.Now()
				resp, err := h.kubelet.Prepare(h.ctx, c)
				took := time.Since(start)
				if err != nil {
					mu.Lock()
					errs = append(errs, err.Error())
					mu.Unlock()
					continue
				}
				if msg := resp.Claims[string(c.UID)].Error; msg != "" {
					mu.Lock()
					refused++
					mu.Unlock()
					// The kubelet unprepares a failed pod's claims too.
					if _, err := h.kubelet.Unprepare(h.ctx, c); err != nil {
						mu.Lock()
						errs = append(errs, err.Error())
						mu.Unlock()
					}
					continue
				}
				mu.Lock()
				if other := overlaps(dev); other != "" {
					errs = append(errs, fmt.Sprintf("%s prepared for %s while %s holds overlapping hardware", dev, c.Name, other))
				}
				held[dev] = c.Name
				latencies = append(latencies, took)
				mu.Unlock()
				// The plugin's own record, read atomically, must never show
				// two prepared claims on overlapping hardware.
				if e := doubleHeld(inv, h.plugin.Manager().PreparedClaims()); e != "" {
					mu.Lock()
					errs = append(errs, e)
					mu.Unlock()
				}
				mu.Lock()
				releasing[c.Name] = true
				mu.Unlock()
				if _, err := h.kubelet.Unprepare(h.ctx, c); err != nil {
					mu.Lock()
					errs = append(errs, err.Error())
					mu.Unlock()
				}
				mu.Lock()
				delete(held, dev)
				delete(releasing, c.Name)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	for _, e := range errs[:min(len(errs), 10)] {
		t.Error(e)
	}
	if len(latencies) < 100 || refused == 0 {
		t.Fatalf("%d of %d cycles prepared, %d refused: the load did not exercise both paths", len(latencies), cycles, refused)
	}
	slices.Sort(latencies)
	t.Logf("%d cycles, %d prepared, %d refused as conflicting; prepare latency p50 %v p99 %v",
		cycles, len(latencies), refused, latencies[len(latencies)/2], latencies[len(latencies)*99/100])
	if left := h.plugin.Manager().PreparedClaims(); len(left) != 0 {
		t.Errorf("%d claims still prepared", len(left))
	}
	if specs, _ := filepath.Glob(filepath.Join(h.opts.CDIRoot, "*.json")); len(specs) != 0 {
		t.Errorf("%d CDI specs leaked", len(specs))
	}
	for g := range 8 {
		if k := n.GPUInstances(g); k != 0 {
			t.Errorf("gpu-%d: %d MIG instances leaked", g, k)
		}
	}
	if _, err := os.Stat(h.opts.PluginDataDir); err != nil {
		t.Error(err)
	}
}

var overlapOf = inventory.Overlap

// doubleHeld names two prepared claims holding overlapping hardware, if any.
func doubleHeld(inv *inventory.Inventory, claims map[types.UID]checkpoint.Claim) string {
	type hold struct{ claim, device string }
	var holds []hold
	for _, c := range claims {
		if c.Phase != checkpoint.PrepareCompleted {
			continue
		}
		for _, d := range c.Devices {
			holds = append(holds, hold{c.Name, d.Device})
		}
	}
	for i, a := range holds {
		for _, b := range holds[i+1:] {
			da, _ := inv.Lookup(a.device)
			db, _ := inv.Lookup(b.device)
			if a.claim != b.claim && (a.device == b.device || overlapOf(da, db)) {
				return fmt.Sprintf("the plugin records %s for %s and %s for %s: overlapping hardware", a.device, a.claim, b.device, b.claim)
			}
		}
	}
	return ""
}
