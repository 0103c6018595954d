package plugin

import (
	"context"
	"fmt"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2"

	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/health"
	"github.com/tessera-dev/tessera/driver/slices"
)

// HealthResendInterval is how often an unchanged health report is sent
// again: well within the kubelet's default 30 s lease.
const HealthResendInterval = 20 * time.Second

// streamHealth sends health reports until ctx ends (nil) or the monitor stops
// (nil: the stream ends and the kubelet decays the devices to unknown rather
// than being told a stale "healthy"). It never blocks on a send once ctx is
// done.
func streamHealth(ctx context.Context, mon *health.Monitor, pool string, reports chan<- kubeletplugin.DeviceHealthReport) error {
	logger := klog.FromContext(ctx)
	snaps, unsubscribe := mon.Subscribe()
	defer unsubscribe()
	clk := mon.Clock()
	resend := clk.NewTicker(HealthResendInterval)
	defer resend.Stop()
	send := func(s health.Snapshot) bool {
		select {
		case reports <- healthReport(pool, s, clk.Now()):
			return true
		case <-ctx.Done():
			return false
		case <-mon.Done():
			return false
		}
	}
	last := <-snaps // Subscribe holds the current state.
	logger.V(2).Info("Kubelet watches device health")
	for send(last) {
		select {
		case <-ctx.Done():
			return nil
		case <-mon.Done():
			return nil
		case last = <-snaps:
		case <-resend.C():
		}
	}
	return nil
}

// healthReport turns the monitor's state into the kubelet's report.
func healthReport(pool string, s health.Snapshot, now time.Time) kubeletplugin.DeviceHealthReport {
	r := kubeletplugin.DeviceHealthReport{Devices: make([]kubeletplugin.DeviceHealth, 0, len(s))}
	for _, d := range s {
		r.Devices = append(r.Devices, kubeletplugin.DeviceHealth{
			PoolName:    pool,
			DeviceName:  d.Name,
			Health:      kubeletplugin.HealthStatus(d.Status),
			LastUpdated: now,
			Message:     d.Message,
		})
	}
	return r
}

// refuseLost fails a claim allocated a device on a GPU NVML cannot reach (the
// monitor's lost taint): a GPU lost while the plugin was down is published
// from its last-known description, and a claim tolerating every taint could
// still get it. A claim prepared already (by either instance of a rolling
// update: Snapshot) is left to the manager, which returns what it holds.
func (d *Driver) refuseLost(ctx context.Context, claim *resourceapi.ResourceClaim) error {
	if d.health == nil || claim.Status.Allocation == nil {
		return nil
	}
	lost := map[string]resourceapi.DeviceTaint{} // by GPU name
	for _, s := range d.health.State() {
		for _, t := range s.Taints {
			if t.Key == health.KeyLost {
				lost[s.Name] = t
			}
		}
	}
	if len(lost) == 0 {
		return nil
	}
	held, err := d.claims.Snapshot(ctx)
	if err != nil {
		return fmt.Errorf("claim %s/%s: %w", claim.Namespace, claim.Name, err)
	}
	if c, ok := held[claim.UID]; ok && c.Phase == checkpoint.PrepareCompleted {
		return nil
	}
	inv := d.claims.Inventory()
	for _, r := range claim.Status.Allocation.Devices.Results {
		if r.Driver != slices.DriverName || r.Pool != d.pool {
			continue
		}
		dev, ok := inv.Lookup(r.Device)
		if !ok {
			continue // the manager names an unknown device
		}
		t, ok := lost[dev.GPU.Name()]
		if !ok {
			continue
		}
		device := ""
		if r.Device != dev.GPU.Name() {
			device = "device " + r.Device + ": "
		}
		since := ""
		if t.TimeAdded != nil {
			since = " since " + t.TimeAdded.UTC().Format(time.RFC3339)
		}
		return fmt.Errorf("claim %s/%s: %sGPU %s (%s) is lost: NVML cannot reach it (taint %s=%s%s); delete the claim to have another GPU allocated, and reset or replace this one",
			claim.Namespace, claim.Name, device, dev.GPU.Name(), dev.GPU.UUID, t.Key, t.Value, since)
	}
	return nil
}
