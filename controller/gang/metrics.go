package gang

import (
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
)

// Metrics count placement attempts, time placements, and count gangs by
// state (read from the leader's informer at each scrape).
type Metrics struct {
	attempts *prometheus.CounterVec
	backfill *prometheus.CounterVec
	duration prometheus.Histogram
	states   *stateCollector
}

// NewMetrics registers the gang metrics with reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		attempts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tessera_gang_placement_attempts_total",
			Help: "Gang placement attempts by result: placed, nofit (no domain fits the whole gang), stale (a device of the plan was taken after the fit check; found before writing), rolledback (a write failed or a device was taken meanwhile).",
		}, []string{"result"}),
		backfill: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tessera_gang_backfill_evictions_total",
			Help: "Evictions of backfill pods at a reservation's start by result: evicted, refused (a PodDisruptionBudget allowed no disruption), failed (any other error). A pod refused or failed keeps its devices; the reservation waits for it and tries again.",
		}, []string{"result"}),
		duration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "tessera_gang_placement_duration_seconds",
			Help:    "Time from a placement's fit search to every member released, for placed gangs.",
			Buckets: prometheus.ExponentialBuckets(0.01, 2, 12),
		}),
		states: &stateCollector{desc: prometheus.NewDesc("tessera_gangs",
			"Gangs by state (Waiting, Placed, Running, Failed: the most advanced true condition), as the leading controller sees them; absent on standbys.",
			[]string{"state"}, nil)},
	}
	for _, c := range []prometheus.Collector{m.attempts, m.backfill, m.duration, m.states} {
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

// backfillEviction counts an eviction of a backfill pod by result.
func (m *Metrics) backfillEviction(result string) {
	if m != nil {
		m.backfill.WithLabelValues(result).Inc()
	}
}

func (m *Metrics) placed(d time.Duration) {
	if m != nil {
		m.duration.Observe(d.Seconds())
	}
}

// watch makes the gang-state gauge read list until the returned func is
// called (when leadership ends).
func (m *Metrics) watch(list func() []any) (stop func()) {
	if m == nil {
		return func() {}
	}
	m.states.set(list)
	return func() { m.states.set(nil) }
}

// stateCollector reports tessera_gangs from the gangs list returns.
type stateCollector struct {
	desc *prometheus.Desc
	mu   sync.Mutex
	list func() []any
}

func (s *stateCollector) set(list func() []any) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.list = list
}

func (s *stateCollector) Describe(ch chan<- *prometheus.Desc) { ch <- s.desc }

func (s *stateCollector) Collect(ch chan<- prometheus.Metric) {
	s.mu.Lock()
	list := s.list
	s.mu.Unlock()
	if list == nil {
		return
	}
	order := []string{gangv1.ConditionFailed, gangv1.ConditionRunning, gangv1.ConditionPlaced, gangv1.ConditionWaiting}
	counts := map[string]int{}
	for _, obj := range list() {
		u, ok := obj.(*unstructured.Unstructured)
		if !ok {
			continue
		}
		g, err := FromUnstructured(u)
		if err != nil {
			continue
		}
		counts[stateOf(g.Status.Conditions, order)]++
	}
	for _, state := range order {
		ch <- prometheus.MustNewConstMetric(s.desc, prometheus.GaugeValue, float64(counts[state]), state)
	}
}

// stateOf is the first condition of order that is true; Waiting when none
// is (a gang not yet looked at waits too).
func stateOf(conds []metav1.Condition, order []string) string {
	for _, c := range order {
		if meta.IsStatusConditionTrue(conds, c) {
			return c
		}
	}
	return gangv1.ConditionWaiting
}
