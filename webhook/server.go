package webhook

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/klog/v2"

	"github.com/tessera-dev/tessera/webhook/keypair"
)

// Path is where admission reviews are served; the webhook configuration's
// clientConfig names it.
const Path = "/validate"

// shutdownTimeout bounds how long Stop waits for reviews in flight; the API
// server gives a webhook call at most 30 s, our configuration 5 s.
const shutdownTimeout = 10 * time.Second

// Server serves admission reviews over HTTPS.
type Server struct {
	srv  *http.Server
	addr string
	done chan struct{}

	mu  sync.Mutex
	err error // why it stopped on its own
}

// Start loads the serving certificate (failing when it cannot), listens on
// o.BindAddress:o.Port, and serves the Handler at Path and liveness at
// /healthz until Stop. reg, if set, receives the webhook's metrics.
func Start(ctx context.Context, o Options, reg prometheus.Registerer) (*Server, error) {
	logger := klog.FromContext(ctx)
	certs, err := keypair.New(ctx, o.TLSCertFile, o.TLSPrivateKeyFile)
	if err != nil {
		return nil, err
	}
	h, err := NewHandler(reg)
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle(Path, h)
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })

	addr := net.JoinHostPort(o.BindAddress, strconv.Itoa(o.Port))
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen on %s (--bind-address, --port): %w", addr, err)
	}
	s := &Server{
		srv: &http.Server{
			Handler:           mux,
			TLSConfig:         &tls.Config{MinVersion: tls.VersionTLS12, GetCertificate: certs.GetCertificate},
			ReadHeaderTimeout: 10 * time.Second,
			// Requests carry the server's logger (klog.FromContext) but not
			// its cancellation: at shutdown, reviews in flight finish.
			BaseContext: func(net.Listener) context.Context { return klog.NewContext(context.WithoutCancel(ctx), logger) },
			ErrorLog:    klog.NewStandardLogger("INFO"),
		},
		addr: ln.Addr().String(),
		done: make(chan struct{}),
	}
	go func() {
		defer close(s.done)
		// Certificates come from TLSConfig.GetCertificate.
		if err := s.srv.ServeTLS(ln, "", ""); err != nil && !errors.Is(err, http.ErrServerClosed) {
			logger.Error(err, "Webhook server failed", "address", s.addr)
			s.mu.Lock()
			s.err = err
			s.mu.Unlock()
		}
	}()
	logger.Info("Serving admission reviews", "address", s.addr, "path", Path)
	return s, nil
}

// Addr is the address the server listens on, with the port chosen for
// port 0.
func (s *Server) Addr() string { return s.addr }

// Done is closed when the server stopped, on its own or by Stop.
func (s *Server) Done() <-chan struct{} { return s.done }

// Err says why the server stopped on its own; nil while it serves.
func (s *Server) Err() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}

// Stop stops accepting connections and waits for reviews in flight, at most
// shutdownTimeout.
func (s *Server) Stop() {
	ctx, cancel := context.WithTimeout(context.Background(), shutdownTimeout)
	defer cancel()
	if err := s.srv.Shutdown(ctx); err != nil {
		_ = s.srv.Close()
	}
	<-s.done
}
