package plugin_test

import (
	"context"
	"net/http"
	"path/filepath"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/tessera-dev/tessera/driver/nodeopen"
	"github.com/tessera-dev/tessera/driver/plugin"
	"github.com/tessera-dev/tessera/test/kubeletsim"
)

// TestDevicesArePublishedOnceTheKubeletRegisteredThePlugin: the scheduler
// sends pods to a node as soon as its slices are there, and a pod whose
// kubelet does not know the driver yet fails its prepare and waits a
// minute for the kubelet's retry. So a fresh node's devices are published
// only after the kubelet registered the plugin, and the plugin is ready
// (/readyz, the chart's readiness probe) only then.
func TestDevicesArePublishedOnceTheKubeletRegisteredThePlugin(t *testing.T) {
	clk := testingclock.NewFakeClock(time.Now())
	h := newHarness(t, true, func(dir string, o *plugin.Options) {
		o.Node = nodeopen.Options{NodeName: nodeName, FakeNode: "pcie-l4x4", FakeRoot: filepath.Join(dir, "host")}
		o.RegistrationWait = time.Hour
		o.MetricsAddress = "127.0.0.1:0"
		o.Clock = clk
	})
	p, err := plugin.Start(h.ctx, h.opts, h.client)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Stop)
	published := func() int {
		list, err := h.client.ResourceV1().ResourceSlices().List(h.ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return len(list.Items)
	}
	readyz := func() int {
		resp, err := http.Get("http://" + p.MetricsAddress() + "/readyz")
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		return resp.StatusCode
	}
	// The publish loop waits for the registration on the clock: once it
	// does, the node's devices are discovered and ready to publish, and a
	// wrong early publish would have been written already.
	if err := wait.PollUntilContextTimeout(h.ctx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		return clk.HasWaiters(), nil
	}); err != nil {
		t.Fatalf("the first publish never waited for the registration: %v", err)
	}
	if n := published(); n != 0 {
		t.Fatalf("%d slices published before the kubelet registered the plugin", n)
	}
	if code := readyz(); code != http.StatusServiceUnavailable {
		t.Errorf("/readyz before the kubelet registered the plugin: %d, want 503", code)
	}
	ctx, cancel := context.WithTimeout(h.ctx, 10*time.Second)
	defer cancel()
	k, err := kubeletsim.Register(ctx, h.opts.RegistrarDir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = k.Close() })
	if err := wait.PollUntilContextTimeout(ctx, 20*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		return published() > 0, nil
	}); err != nil {
		t.Fatalf("no slice published after the kubelet registered the plugin: %v", err)
	}
	if code := readyz(); code != http.StatusOK {
		t.Errorf("/readyz once the kubelet registered the plugin: %d, want 200", code)
	}
}
