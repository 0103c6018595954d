package webhook

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// Verdicts and the kind label of requests for kinds the webhook does not
// review (bounded, whatever the webhook configuration sends).
const (
	verdictAllowed   = "allowed"
	verdictDenied    = "denied"
	verdictMalformed = "malformed"
	kindOther        = "other"
)

// metrics count reviews. A nil *metrics counts nothing.
type metrics struct {
	reviews *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	if reg == nil {
		return nil, nil
	}
	m := &metrics{reviews: prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tessera_webhook_reviews_total",
		Help: "Admission reviews answered, by kind (ResourceClaim, ResourceClaimTemplate, DeviceClass, other; empty when the request was unreadable) and verdict (allowed, denied, malformed).",
	}, []string{"kind", "verdict"})}
	if err := reg.Register(m.reviews); err != nil {
		return nil, fmt.Errorf("register webhook metrics: %w", err)
	}
	return m, nil
}

func (m *metrics) count(kind, verdict string) {
	if m == nil {
		return
	}
	m.reviews.WithLabelValues(kind, verdict).Inc()
}
