package plugin

import (
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"k8s.io/dynamic-resource-allocation/resourceslice"

	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/prepare"
)

// claimMetrics count prepares and unprepares as the kubelet asked for them.
type claimMetrics struct {
	prepares           *prometheus.CounterVec
	duration           prometheus.Histogram
	unprepares         *prometheus.CounterVec
	unprepareDurations prometheus.Histogram
	// published is the number of devices last handed to the slice
	// controller.
	published prometheus.Gauge
	// inFlight counts the claims being prepared now.
	inFlight prometheus.Gauge
}

// newClaimMetrics registers the claim metrics, and the prepared-devices gauge
// read from the manager at each scrape.
func newClaimMetrics(reg prometheus.Registerer, mgr *prepare.Manager) (*claimMetrics, error) {
	m := &claimMetrics{
		prepares: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tessera_prepare_total",
			Help: "Claims the kubelet asked to prepare, by result (success, error).",
		}, []string{"result"}),
		duration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "tessera_prepare_duration_seconds",
			Help:    "How long preparing one claim took, successful or not.",
			Buckets: prometheus.ExponentialBuckets(0.001, 4, 9), // 1 ms .. 65 s
		}),
		unprepares: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tessera_unprepare_total",
			Help: "Claims the kubelet asked to unprepare, by result (success, error).",
		}, []string{"result"}),
		unprepareDurations: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "tessera_unprepare_duration_seconds",
			Help:    "How long unpreparing one claim took, successful or not.",
			Buckets: prometheus.ExponentialBuckets(0.001, 4, 9),
		}),
		published: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "tessera_published_devices",
			Help: "Devices (whole GPUs, MIG partitions) in the ResourceSlices last published for this node.",
		}),
		inFlight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "tessera_prepares_in_flight",
			Help: "Claims being prepared now; one that stays is stuck (a daemon that does not start, a claim lock the other instance of a rolling update holds).",
		}),
	}
	prepared := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "tessera_prepared_devices",
		Help: "Devices held by claims whose prepare completed.",
	}, func() float64 {
		n := 0
		for _, c := range mgr.PreparedClaims() {
			if c.Phase == checkpoint.PrepareCompleted {
				n += len(c.Devices)
			}
		}
		return float64(n)
	})
	for _, c := range []prometheus.Collector{m.prepares, m.duration, m.unprepares, m.unprepareDurations, m.published, m.inFlight, prepared,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{})} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register plugin metrics: %w", err)
		}
	}
	for _, r := range []string{"success", "error"} {
		m.prepares.WithLabelValues(r)
		m.unprepares.WithLabelValues(r)
	}
	return m, nil
}

// observeCheckpointWrites registers the histogram of checkpoint writes and
// has the store report to it. Every prepare and unprepare waits for at
// least one write (or shares one with concurrent claims), so its count
// against the claims shows the group commit at work and its durations show
// what the node's disk costs a pod start.
func observeCheckpointWrites(reg prometheus.Registerer, store *checkpoint.Store) error {
	h := prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "tessera_checkpoint_write_duration_seconds",
		Help:    "How long each write of the claim checkpoint took, fsync included.",
		Buckets: prometheus.ExponentialBuckets(0.00025, 4, 8), // 0.25 ms .. 4 s
	})
	if err := reg.Register(h); err != nil {
		return fmt.Errorf("register checkpoint metrics: %w", err)
	}
	store.OnWrite = func(took time.Duration) { h.Observe(took.Seconds()) }
	return nil
}

func result(err error) string {
	if err != nil {
		return "error"
	}
	return "success"
}

func (m *claimMetrics) prepared(err error, took time.Duration) {
	if m == nil {
		return
	}
	m.prepares.WithLabelValues(result(err)).Inc()
	m.duration.Observe(took.Seconds())
}

func (m *claimMetrics) unprepared(err error, took time.Duration) {
	if m == nil {
		return
	}
	m.unprepares.WithLabelValues(result(err)).Inc()
	m.unprepareDurations.Observe(took.Seconds())
}

// preparing counts a claim's prepare in flight until the returned func.
func (m *claimMetrics) preparing() func() {
	if m == nil {
		return func() {}
	}
	m.inFlight.Inc()
	return m.inFlight.Dec
}

// publishedDevices records what a successful publish handed over.
func (m *claimMetrics) publishedDevices(res *resourceslice.DriverResources) {
	if m == nil {
		return
	}
	n := 0
	for _, pool := range res.Pools {
		for _, s := range pool.Slices {
			n += len(s.Devices)
		}
	}
	m.published.Set(float64(n))
}
