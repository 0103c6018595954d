package health

import (
	"fmt"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the health monitor's Prometheus metrics.
type Metrics struct {
	// Events counts NVML health events and lost GPUs by GPU, kind and XID.
	Events *prometheus.CounterVec
	// Healthy is 1 for a healthy GPU, 0 for an unhealthy or unknown one.
	Healthy *prometheus.GaugeVec
}

// NewMetrics creates the metrics and registers them with reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		Events: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tessera_health_events_total",
			Help: "GPU health events seen: XID critical errors, ECC errors (single- and double-bit) and lost GPUs.",
		}, []string{"gpu", "uuid", "kind", "xid"}),
		Healthy: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "tessera_device_healthy",
			Help: "1 when the GPU is healthy, 0 when it is unhealthy or its health is unknown.",
		}, []string{"gpu"}),
	}
	for _, c := range []prometheus.Collector{m.Events, m.Healthy} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register health metrics: %w", err)
		}
	}
	return m, nil
}

func (m *Metrics) count(d *device, ev event) {
	if m == nil {
		return
	}
	xid := ""
	if ev.kind == kindXID {
		xid = strconv.FormatUint(ev.xid, 10)
	}
	m.Events.WithLabelValues(d.name, d.uuid, ev.kind, xid).Inc()
}

func (m *Metrics) set(s Snapshot) {
	if m == nil {
		return
	}
	for _, d := range s {
		v := 0.0
		if d.Status == Healthy {
			v = 1
		}
		m.Healthy.WithLabelValues(d.Name).Set(v)
	}
}
