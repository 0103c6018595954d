package plugin

import (
	"context"
	"time"

	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2"

	"github.com/tessera-dev/tessera/driver/health"
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
