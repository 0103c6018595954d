// Package metricsserver serves a component's Prometheus metrics (/metrics)
// and liveness (/healthz) over plain HTTP on a separate address, the way
// Kubernetes components do. It is shared by Tessera's binaries so that each
// serves them alike.
package metricsserver

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
)

// NewRegistry returns a registry with the Go runtime and process collectors,
// which every component exports.
func NewRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return reg
}

// Server serves one registry until Stop.
type Server struct {
	srv  *http.Server
	addr string
	done chan struct{}
}

// Start listens on addr (host:port) and serves reg at /metrics and the
// component's liveness at /healthz: 200 while alive returns nil, 503 with its
// error otherwise. flag names the address's flag in errors.
func Start(ctx context.Context, flag, addr string, reg *prometheus.Registry, alive func() error) (*Server, error) {
	logger := klog.FromContext(ctx)
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen on %s %s: %w; choose a free port or leave it empty to serve no metrics", flag, addr, err)
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
	s := &Server{
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

// Addr is the address the server listens on (with the port chosen when addr
// asked for port 0).
func (s *Server) Addr() string { return s.addr }

// Stop closes the listener and waits up to five seconds for scrapes in
// flight. A nil Server is fine.
func (s *Server) Stop() {
	if s == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = s.srv.Shutdown(ctx)
	<-s.done
}
