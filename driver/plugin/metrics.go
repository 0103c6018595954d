package plugin

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"k8s.io/klog/v2"

	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/prepare"
)

// claimMetrics count prepares and unprepares as the kubelet asked for them.
type claimMetrics struct {
	prepares   *prometheus.CounterVec
	duration   prometheus.Histogram
	unprepares *prometheus.CounterVec
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
	for _, c := range []prometheus.Collector{m.prepares, m.duration, m.unprepares, prepared,
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

func (m *claimMetrics) unprepared(err error) {
	if m == nil {
		return
	}
	m.unprepares.WithLabelValues(result(err)).Inc()
}

// metricsServer serves /metrics and /healthz over HTTP.
type metricsServer struct {
	srv  *http.Server
	addr string
	done chan struct{}
}

// serveMetrics listens on addr and serves the registry at /metrics and the
// plugin's liveness at /healthz (200 while it runs, 503 with the cause once
// it stopped on its own) until stop.
func serveMetrics(ctx context.Context, addr string, reg *prometheus.Registry, alive func() error) (*metricsServer, error) {
	logger := klog.FromContext(ctx)
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen on --metrics-address %s: %w; choose a free port or leave it empty to serve no metrics", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		if err := alive(); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ok\n"))
	})
	s := &metricsServer{
		srv:  &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second},
		addr: ln.Addr().String(),
		done: make(chan struct{}),
	}
	go func() {
		defer close(s.done)
		if err := s.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			logger.Error(err, "Metrics server failed", "address", s.addr)
		}
	}()
	logger.Info("Serving metrics", "address", s.addr)
	return s, nil
}

// stop closes the listener and waits up to five seconds for scrapes in
// flight.
func (s *metricsServer) stop() {
	if s == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = s.srv.Shutdown(ctx)
	<-s.done
}
