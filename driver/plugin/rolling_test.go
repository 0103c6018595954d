package plugin_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"

	"github.com/tessera-dev/tessera/driver/plugin"
	"github.com/tessera-dev/tessera/test/kubeletsim"
)

// TestRollingUpdateInstancesShareTheNodeState runs two plugin instances side
// by side on one node, as a DaemonSet rolling update does (each with its own
// pod UID, one data directory): claims prepared through one are known to the
// other, a device held through one is refused through the other, and a claim
// prepared by the old instance is unprepared by the new one — under
// concurrent calls to both.
func TestRollingUpdateInstancesShareTheNodeState(t *testing.T) {
	h, n := startOnFakeNode(t, "dgx-h100", func(o *plugin.Options) { o.PodUID = "old-pod" })
	newOpts := h.opts
	newOpts.PodUID = "new-pod"
	newer, err := plugin.Start(h.ctx, newOpts, h.client)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(newer.Stop)
	connect := func(uid string) *kubeletsim.Kubelet {
		path := filepath.Join(h.opts.RegistrarDir, kubeletplugin.RollingUpdateRegistrarSocketFile(h.opts.RegistrarDir, driverName, types.UID(uid)))
		ctx, cancel := context.WithTimeout(h.ctx, 10*time.Second)
		defer cancel()
		for {
			if _, err := os.Stat(path); err == nil {
				break
			}
			if ctx.Err() != nil {
				t.Fatalf("no registration socket %s", path)
			}
			time.Sleep(10 * time.Millisecond)
		}
		k, err := kubeletsim.RegisterAt(ctx, path)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = k.Close() })
		return k
	}
	oldK, newK := connect("old-pod"), connect("new-pod")

	prep := func(k *kubeletsim.Kubelet, c kubeletsim.Claim) string {
		resp, err := k.Prepare(h.ctx, c)
		if err != nil {
			return err.Error()
		}
		return resp.Claims[string(c.UID)].Error
	}
	// Known across instances.
	a := h.claim("a", "gpu-0")
	if msg := prep(oldK, a); msg != "" {
		t.Fatal(msg)
	}
	if msg := prep(newK, h.claim("b", "gpu-0")); !strings.Contains(msg, "already prepared for claim default/a") {
		t.Fatalf("the new instance handed out gpu-0, held through the old one: %q", msg)
	}
	// Unprepared by the other instance, partition and all.
	p := h.claim("p", "gpu-3-mig-1g10gb-6")
	if msg := prep(oldK, p); msg != "" {
		t.Fatal(msg)
	}
	if _, err := newK.Unprepare(h.ctx, p); err != nil {
		t.Fatal(err)
	}
	if k := n.GPUInstances(3); k != 0 {
		t.Errorf("the new instance's unprepare left %d MIG instances", k)
	}
	// Concurrent calls to both never double-hold a device.
	var wg sync.WaitGroup
	var mu sync.Mutex
	winners := map[string][]string{}
	for i := range 16 {
		k := oldK
		if i%2 == 1 {
			k = newK
		}
		dev := fmt.Sprintf("gpu-%d", 4+i%4)
		c := h.claim(fmt.Sprintf("race-%d", i), dev)
		wg.Go(func() {
			if prep(k, c) == "" {
				mu.Lock()
				winners[dev] = append(winners[dev], c.Name)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	for dev, w := range winners {
		if len(w) != 1 {
			t.Errorf("%s prepared for %v", dev, w)
		}
	}
	if len(winners) != 4 {
		t.Errorf("winners %v, want one per GPU 4-7", winners)
	}
}
