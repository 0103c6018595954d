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

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
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
	oldK, newK := connectInstance(t, h, "old-pod"), connectInstance(t, h, "new-pod")

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

// connectInstance registers a simulated kubelet with the rolling-update
// instance of the given pod UID.
func connectInstance(t *testing.T, h *harness, uid string) *kubeletsim.Kubelet {
	t.Helper()
	return connectInstanceAt(t, h, h.opts.RegistrarDir, uid)
}

// connectInstanceAt is connectInstance for a registration directory of its
// own.
func connectInstanceAt(t *testing.T, h *harness, registrarDir, uid string) *kubeletsim.Kubelet {
	t.Helper()
	path := filepath.Join(registrarDir, kubeletplugin.RollingUpdateRegistrarSocketFile(registrarDir, driverName, types.UID(uid)))
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

// prepareWithin prepares c through k and fails the test unless it succeeds
// before the wait ends: what would hold it up is a lock held across
// something that does not end until the test releases it.
func prepareWithin(t *testing.T, h *harness, k *kubeletsim.Kubelet, c kubeletsim.Claim, why string) {
	t.Helper()
	done := make(chan string, 1)
	go func() {
		resp, err := k.Prepare(h.ctx, c)
		switch {
		case err != nil:
			done <- err.Error()
		default:
			done <- resp.Claims[string(c.UID)].Error
		}
	}()
	select {
	case msg := <-done:
		if msg != "" {
			t.Fatalf("prepare of %s: %s", c.Name, msg)
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("prepare of %s did not complete in 20 s: it waited for %s", c.Name, why)
	}
}

// TestASlowMPSDaemonStartHoldsUpNoOtherClaim: in a rolling update, a claim
// whose MPS daemon pod takes long to run (here: until the test lets the API
// server answer) holds up no other claim's prepare, through either
// instance; the node lock is not held while the daemon is awaited.
func TestASlowMPSDaemonStartHoldsUpNoOtherClaim(t *testing.T) {
	h, _ := startOnFakeNode(t, "pcie-l4x4", func(o *plugin.Options) {
		o.PodUID = "old-pod"
		o.MPSImage, o.Namespace = "pause", "tessera-system"
	})
	// The old instance's daemon reads stall.
	h.plugin.Stop()
	_ = h.kubelet.Close()
	daemon := newStall("tessera-mps-uid-mps")
	old, err := plugin.Start(h.ctx, h.opts, stalledPods{h.client, daemon})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(old.Stop)
	newOpts := h.opts
	newOpts.PodUID = "new-pod"
	newer, err := plugin.Start(h.ctx, newOpts, h.client)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(newer.Stop)
	t.Cleanup(daemon.release) // first: the old instance's Stop waits for it
	oldK, newK := connectInstance(t, h, "old-pod"), connectInstance(t, h, "new-pod")

	slow := h.claimWithConfig("mps", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS"}}`, "gpu-0")
	slowDone := make(chan string, 1)
	go func() {
		resp, err := oldK.Prepare(h.ctx, slow)
		if err != nil {
			slowDone <- err.Error()
			return
		}
		slowDone <- resp.Claims[string(slow.UID)].Error
	}()
	<-daemon.asked // the daemon is being awaited
	prepareWithin(t, h, oldK, h.claim("same", "gpu-1"), "another claim's MPS daemon, through the same instance")
	prepareWithin(t, h, newK, h.claim("other", "gpu-2"), "another claim's MPS daemon, through the other instance")
	daemon.release()
	if msg := <-slowDone; msg != "" {
		t.Fatalf("prepare of the MPS claim: %s", msg)
	}
}

// claimWithConfig creates an allocated claim with an opaque configuration
// of the driver for all its devices.
func (h *harness) claimWithConfig(name, config string, devices ...string) kubeletsim.Claim {
	h.t.Helper()
	c := h.claim(name, devices...)
	obj, err := h.client.ResourceV1().ResourceClaims("default").Get(h.ctx, name, metav1.GetOptions{})
	if err != nil {
		h.t.Fatal(err)
	}
	obj.Status.Allocation.Devices.Config = []resourceapi.DeviceAllocationConfiguration{{
		Source:              resourceapi.AllocationConfigSourceClaim,
		DeviceConfiguration: resourceapi.DeviceConfiguration{Opaque: &resourceapi.OpaqueDeviceConfiguration{Driver: driverName, Parameters: runtime.RawExtension{Raw: []byte(config)}}},
	}}
	if _, err := h.client.ResourceV1().ResourceClaims("default").UpdateStatus(h.ctx, obj, metav1.UpdateOptions{}); err != nil {
		h.t.Fatal(err)
	}
	return c
}

// TestTheStaleSweepHoldsUpNoPrepare: in a rolling update, the stale-claim
// sweep asking the API server about a prepared claim (here: an API server
// that does not answer until the test lets it) holds up no prepare.
func TestTheStaleSweepHoldsUpNoPrepare(t *testing.T) {
	h, _ := startOnFakeNode(t, "pcie-l4x4", func(o *plugin.Options) { o.PodUID = "old-pod" })
	if _, msg := h.prepare(h.claim("held", "gpu-0")); msg != "" {
		t.Fatal(msg)
	}
	h.plugin.Stop()
	_ = h.kubelet.Close()
	read := newStall("held")
	p, err := plugin.Start(h.ctx, h.opts, stalledClaims{h.client, read}) // the sweep runs at start
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Stop)
	t.Cleanup(read.release) // first: Stop waits for the sweep
	k := connectInstance(t, h, "old-pod")
	<-read.asked
	prepareWithin(t, h, k, h.claim("next", "gpu-1"), "the stale-claim sweep's API read")
}
