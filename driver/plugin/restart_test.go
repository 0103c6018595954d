package plugin_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"

	"github.com/tessera-dev/tessera/driver/health"
	"github.com/tessera-dev/tessera/driver/plugin"
)

// stopAndForgetSlices stops the plugin and deletes its published slices, so
// that what the next start publishes is all there is to see.
func (h *healthHarness) stopAndForgetSlices() {
	h.t.Helper()
	h.plugin.Stop()
	if err := h.client.ResourceV1().ResourceSlices().DeleteCollection(h.ctx, metav1.DeleteOptions{}, metav1.ListOptions{}); err != nil {
		h.t.Fatal(err)
	}
}

func TestFaultTaintSurvivesAPluginRestart(t *testing.T) {
	h := startHealth(t, "pcie-l4x4")
	if err := h.node.InjectXID(1, 48); err != nil {
		t.Fatal(err)
	}
	h.awaitSlices("taint on gpu-1", func(m map[string][]string) bool { return len(m["gpu-1"]) > 0 })
	h.stopAndForgetSlices()
	h.restart()

	// gpu-1 answers probes: only the saved state keeps it tainted.
	if s := h.plugin.Health().State()[1]; s.Status != health.Unhealthy {
		t.Fatalf("after restart gpu-1 is %s %v, want Unhealthy", s.Status, s.Taints)
	}
	slices := h.awaitSlices("gpu-1 tainted after restart", func(m map[string][]string) bool {
		return cmp.Equal(m, map[string][]string{"gpu-0": {}, "gpu-1": {"gpu.tessera.dev/xid=48:NoSchedule"}, "gpu-2": {}, "gpu-3": {}})
	})
	for _, s := range slices {
		for _, d := range s.Spec.Devices {
			if len(d.Taints) > 0 && !d.Taints[0].TimeAdded.Time.Equal(healthStart) {
				t.Errorf("%s TimeAdded %s, want the fault's time %s", d.Name, d.Taints[0].TimeAdded, healthStart)
			}
		}
	}
	reports, _ := h.watchHealth(h.ctx)
	awaitReport(t, reports, func(m map[string]kubeletplugin.HealthStatus) bool {
		return cmp.Equal(m, allHealthyBut("gpu-1", kubeletplugin.HealthStatusUnhealthy))
	})

	// The ordinary rule lifts it: quiet since the fault, then a passing probe.
	h.clock.Step(healthQuiet)
	h.awaitSlices("gpu-1 untainted", func(m map[string][]string) bool { return len(m) == 4 && len(m["gpu-1"]) == 0 })
	awaitReport(t, reports, func(m map[string]kubeletplugin.HealthStatus) bool { return cmp.Equal(m, allHealthyBut("", "")) })
}

func TestCorruptedHealthStateDoesNotStopThePlugin(t *testing.T) {
	h := startHealth(t, "pcie-l4x4")
	h.stopAndForgetSlices()
	if err := os.WriteFile(filepath.Join(h.opts.PluginDataDir, plugin.HealthStateFile), []byte("{\"version\":1,\"gpus\":{\"GPU-\x00"), 0o600); err != nil {
		t.Fatal(err)
	}
	h.restart()
	for _, d := range h.plugin.Health().State() {
		if d.Status != health.Healthy {
			t.Errorf("%s is %s with an unreadable state file: %v", d.Name, d.Status, d.Taints)
		}
	}
	h.awaitSlices("untainted slices", func(m map[string][]string) bool {
		return cmp.Equal(m, map[string][]string{"gpu-0": {}, "gpu-1": {}, "gpu-2": {}, "gpu-3": {}})
	})
}

func TestGPULostWhileThePluginWasDownIsPublishedTaintedAndRefused(t *testing.T) {
	h := startHealth(t, "pcie-l4x4")
	h.awaitSlices("initial slices", func(m map[string][]string) bool { return len(m) == 4 })
	uuid := h.plugin.Health().State()[3].UUID
	h.stopAndForgetSlices()
	// No monitor runs: no XID is seen, the GPU just no longer answers.
	if err := h.node.LoseGPU(3); err != nil {
		t.Fatal(err)
	}
	h.restart()
	want := map[string][]string{"gpu-0": {}, "gpu-1": {}, "gpu-2": {},
		"gpu-3": {"gpu.tessera.dev/lost=gpu-is-lost:NoSchedule", "gpu.tessera.dev/unmonitored=gpu-is-lost:None"}}
	h.awaitSlices("gpu-3 published tainted", func(m map[string][]string) bool { return cmp.Equal(m, want) })
	if got, _ := h.publishedTaints(); !cmp.Equal(got, want) {
		t.Errorf("published taints (-want +got):\n%s", cmp.Diff(want, got))
	}

	// A claim that got it anyway (tolerating every taint) is refused.
	_, errMsg := h.prepare(h.claim("on-lost", "gpu-3"))
	if wantMsg := "GPU gpu-3 (" + uuid + ") is lost: "; !strings.Contains(errMsg, wantMsg) {
		t.Errorf("prepare on the lost GPU: error %q, want it to contain %q", errMsg, wantMsg)
	}
	if _, errMsg := h.prepare(h.claim("on-good", "gpu-2")); errMsg != "" {
		t.Errorf("prepare on a good GPU: %s", errMsg)
	}

	// Back on the bus and quiet: usable again, from its last-known description.
	if err := h.node.RecoverGPU(3); err != nil {
		t.Fatal(err)
	}
	h.clock.Step(healthQuiet + time.Second)
	h.awaitSlices("gpu-3 untainted", func(m map[string][]string) bool { return len(m) == 4 && len(m["gpu-3"]) == 0 })
	if _, errMsg := h.prepare(h.claim("on-recovered", "gpu-3")); errMsg != "" {
		t.Errorf("prepare on the recovered GPU: %s", errMsg)
	}
}

func TestLostGPUIsLeftOutWhenDeviceHealthIsOff(t *testing.T) {
	h := startHealth(t, "pcie-l4x4", "DeviceHealth=false")
	h.awaitSlices("initial slices", func(m map[string][]string) bool { return len(m) == 4 })
	h.stopAndForgetSlices()
	if err := h.node.LoseGPU(0); err != nil {
		t.Fatal(err)
	}
	h.restart()
	// Nothing would taint it: publishing it would offer a dead GPU.
	h.awaitSlices("slices without gpu-0", func(m map[string][]string) bool {
		return cmp.Equal(m, map[string][]string{"gpu-1": {}, "gpu-2": {}, "gpu-3": {}})
	})
}
