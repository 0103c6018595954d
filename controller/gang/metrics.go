package gang

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics count placement attempts and time placements.
type Metrics struct {
	attempts *prometheus.CounterVec
	duration prometheus.Histogram
}

// NewMetrics registers the gang metrics with reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		attempts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tessera_gang_placement_attempts_total",
			Help: "Gang placement attempts by result: placed, nofit (no domain fits the whole gang), rolledback (a write failed or a device was taken meanwhile).",
		}, []string{"result"}),
		duration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "tessera_gang_placement_duration_seconds",
			Help:    "Time from a placement's fit search to every member released, for placed gangs.",
			Buckets: prometheus.ExponentialBuckets(0.01, 2, 12),
		}),
	}
	for _, c := range []prometheus.Collector{m.attempts, m.duration} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

func (m *Metrics) attempt(result string) {
	if m != nil {
		m.attempts.WithLabelValues(result).Inc()
	}
}

func (m *Metrics) placed(d time.Duration) {
	if m != nil {
		m.duration.Observe(d.Seconds())
	}
}
