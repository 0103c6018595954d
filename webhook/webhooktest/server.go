package webhooktest

import (
	"context"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tessera-dev/tessera/webhook"
)

// Server is a webhook serving on 127.0.0.1 with a certificate of a test CA.
type Server struct {
	*webhook.Server
	CA     *CA
	Volume *SecretVolume
	// Registry holds the webhook's metrics.
	Registry *prometheus.Registry
}

// Start runs the webhook until the test ends.
func Start(ctx context.Context, t testing.TB) *Server {
	t.Helper()
	ca := NewCA(t)
	volume, _ := ca.NewSecretVolume(t, t.TempDir(), "127.0.0.1")
	reg := prometheus.NewRegistry()
	srv, err := webhook.Start(ctx, webhook.Options{
		BindAddress: "127.0.0.1", TLSCertFile: volume.CertFile(), TLSPrivateKeyFile: volume.KeyFile(),
	}, reg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	return &Server{Server: srv, CA: ca, Volume: volume, Registry: reg}
}
