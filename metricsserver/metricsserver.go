// Package metricsserver serves a component's Prometheus metrics (/metrics),
// liveness (/healthz) and readiness (/readyz) over plain HTTP, apart from
// its API, the way
// Kubernetes components do. It is shared by Tessera's binaries so that each
// serves them alike, from the same flags.
//
// As with kube-proxy's --metrics-bind-address and --healthz-bind-address,
// metrics and liveness have an address each, and the safe default differs:
// metrics (what the node runs, its claims and devices) stay on the loopback
// interface unless an operator opens them, while liveness, which the kubelet
// probes from outside the pod, says only "ok" or why not.
package metricsserver

import (
	"context"
	"errors"
	"fmt"
	"github.com/tessera-dev/tessera/component"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/pflag"
	"k8s.io/klog/v2"
)

// DefaultMetricsAddress is --metrics-address unless set: the loopback
// interface only, reachable from inside the pod (or the host, for a host
// process) and from nowhere else.
const DefaultMetricsAddress = "127.0.0.1:8080"

// NewRegistry returns a registry with the Go runtime and process collectors,
// which every component exports.
func NewRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return reg
}

// Addresses are where a component serves metrics and liveness: the flags
// --metrics-address and --health-address, with environment fallbacks.
// Components embed it in their options.
type Addresses struct {
	// MetricsAddress serves /metrics, and /healthz beside it (host:port);
	// empty serves neither there.
	MetricsAddress string
	// HealthAddress serves /healthz alone (host:port), for the kubelet's
	// probes; empty serves no such listener.
	HealthAddress string
}

// AddFlags registers --metrics-address and --health-address.
func (a *Addresses) AddFlags(fs *pflag.FlagSet) {
	fs.StringVar(&a.MetricsAddress, "metrics-address", component.Env("METRICS_ADDRESS", DefaultMetricsAddress), "Address (host:port) to serve Prometheus metrics at /metrics, and liveness at /healthz, over plain HTTP; empty serves nothing there. The default is the loopback interface only; \"0.0.0.0:8080\" or \":8080\" opens them on every interface, for a Prometheus on the pod network. Environment: METRICS_ADDRESS.")
	fs.StringVar(&a.HealthAddress, "health-address", component.Env("HEALTH_ADDRESS", ""), "Address (host:port) to serve liveness alone at /healthz over plain HTTP, for the kubelet's probes, e.g. \":8081\" (every interface); empty serves /healthz only at --metrics-address. Environment: HEALTH_ADDRESS.")
}

// Validate checks that each address is host:port or empty.
func (a *Addresses) Validate() error {
	for _, f := range []struct{ flag, addr string }{{"--metrics-address", a.MetricsAddress}, {"--health-address", a.HealthAddress}} {
		if f.addr == "" {
			continue
		}
		if _, _, err := net.SplitHostPort(f.addr); err != nil {
			return fmt.Errorf("%s %q: want host:port (\"127.0.0.1:8080\", \":8081\") or empty for none: %w", f.flag, f.addr, err)
		}
	}
	return nil
}

// Server serves one registry and a liveness check until Stop.
type Server struct {
	metrics, health *listener // nil where not served; the same when the addresses are
}

// listener is one HTTP server on one address.
type listener struct {
	srv  *http.Server
	addr string
	done chan struct{}
}

// Start serves reg at /metrics and the component's liveness at /healthz on
// a.MetricsAddress, and /healthz alone on a.HealthAddress: 200 while alive
// returns nil, 503 with its error otherwise. With both addresses empty it
// serves nothing and returns a nil Server (whose methods are safe to call).
func Start(ctx context.Context, a Addresses, reg *prometheus.Registry, alive func() error) (*Server, error) {
	return StartProbes(ctx, a, reg, Probes{Alive: alive})
}

// Probes say whether a component is alive (/healthz) and ready (/readyz).
type Probes struct {
	Alive func() error
	// Ready, if set, must return nil too for /readyz to say ok; nil means
	// ready while alive.
	Ready func() error
}

// StartProbes is Start with readiness: /readyz is served wherever /healthz
// is, 200 while both probes return nil, 503 with the first error otherwise.
func StartProbes(ctx context.Context, a Addresses, reg *prometheus.Registry, p Probes) (*Server, error) {
	probe := func(checks ...func() error) http.HandlerFunc {
		return func(w http.ResponseWriter, _ *http.Request) {
			for _, check := range checks {
				if check == nil {
					continue
				}
				if err := check(); err != nil {
					http.Error(w, err.Error(), http.StatusServiceUnavailable)
					return
				}
			}
			_, _ = w.Write([]byte("ok\n"))
		}
	}
	healthz, readyz := probe(p.Alive), probe(p.Alive, p.Ready)
	var s Server
	if a.MetricsAddress != "" {
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
		mux.HandleFunc("/healthz", healthz)
		mux.HandleFunc("/readyz", readyz)
		l, err := listen(ctx, "--metrics-address", a.MetricsAddress, mux)
		if err != nil {
			return nil, err
		}
		s.metrics = l
		klog.FromContext(ctx).Info("Serving metrics", "address", l.addr)
	}
	switch {
	case a.HealthAddress == "":
	case a.HealthAddress == a.MetricsAddress:
		s.health = s.metrics
	default:
		mux := http.NewServeMux()
		mux.HandleFunc("/healthz", healthz)
		mux.HandleFunc("/readyz", readyz)
		l, err := listen(ctx, "--health-address", a.HealthAddress, mux)
		if err != nil {
			s.Stop()
			return nil, err
		}
		s.health = l
		klog.FromContext(ctx).Info("Serving liveness", "address", l.addr)
	}
	if s.metrics == nil && s.health == nil {
		return nil, nil
	}
	return &s, nil
}

// listen serves h on addr; flag names the address's flag in errors.
func listen(ctx context.Context, flag, addr string, h http.Handler) (*listener, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen on %s %s: %w; choose a free port or leave it empty to serve nothing there", flag, addr, err)
	}
	l := &listener{
		srv:  &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second},
		addr: ln.Addr().String(),
		done: make(chan struct{}),
	}
	go func() {
		defer close(l.done)
		if err := l.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			klog.FromContext(ctx).Error(err, "HTTP server failed", "flag", flag, "address", l.addr)
		}
	}()
	return l, nil
}

// Addr is the address /metrics is served at (with the port chosen when
// --metrics-address asked for port 0); empty when metrics are not served.
func (s *Server) Addr() string {
	if s == nil || s.metrics == nil {
		return ""
	}
	return s.metrics.addr
}

// HealthAddr is the address /healthz alone is served at (the port chosen
// for port 0); empty without --health-address.
func (s *Server) HealthAddr() string {
	if s == nil || s.health == nil {
		return ""
	}
	return s.health.addr
}

// Stop closes the listeners and waits up to five seconds for requests in
// flight. A nil Server is fine.
func (s *Server) Stop() {
	if s == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	listeners := []*listener{s.metrics}
	if s.health != s.metrics {
		listeners = append(listeners, s.health)
	}
	for _, l := range listeners {
		if l != nil {
			_ = l.srv.Shutdown(ctx)
			<-l.done
		}
	}
}
