package webhook

import (
	"fmt"
	"net"
	"strconv"

	"github.com/spf13/pflag"

	"github.com/tessera-dev/tessera/component"
	"github.com/tessera-dev/tessera/metricsserver"
)

// Options are the webhook server's settings, from flags with environment
// fallbacks for a Deployment.
type Options struct {
	// BindAddress is the IP address to listen on.
	BindAddress string
	// Port is the HTTPS port; 0 picks a free one (tests).
	Port int
	// TLSCertFile and TLSPrivateKeyFile are the serving certificate and key,
	// PEM. They are read again when they change.
	TLSCertFile       string
	TLSPrivateKeyFile string
	// Addresses are where /metrics and /healthz are served over plain HTTP
	// (--metrics-address, --health-address).
	metricsserver.Addresses

	envErr error // an unparsable environment fallback, reported by Validate
}

// AddFlags registers the options.
func (o *Options) AddFlags(fs *pflag.FlagSet) {
	fs.StringVar(&o.BindAddress, "bind-address", component.Env("BIND_ADDRESS", "0.0.0.0"), "IP address to serve admission reviews on (0.0.0.0 or :: for every interface). Environment: BIND_ADDRESS.")
	port := 8443
	if v := component.Env("PORT", ""); v != "" {
		p, err := strconv.Atoi(v)
		if err != nil {
			o.envErr = fmt.Errorf("environment PORT=%q: want a port number: %w", v, err)
		}
		port = p
	}
	fs.IntVar(&o.Port, "port", port, "HTTPS port to serve admission reviews on, at path "+Path+" (liveness at /healthz). Environment: PORT.")
	fs.StringVar(&o.TLSCertFile, "tls-cert-file", component.Env("TLS_CERT_FILE", ""), "Serving certificate (PEM; the chain after the leaf), e.g. tls.crt of a kubernetes.io/tls Secret that cert-manager renews. Read again when it changes; no restart needed. Environment: TLS_CERT_FILE.")
	fs.StringVar(&o.TLSPrivateKeyFile, "tls-private-key-file", component.Env("TLS_PRIVATE_KEY_FILE", ""), "Key of the serving certificate (PEM), e.g. tls.key of the same Secret. Environment: TLS_PRIVATE_KEY_FILE.")
	o.Addresses.AddFlags(fs)
}

// Validate checks the options before anything starts.
func (o *Options) Validate() error {
	if o.envErr != nil {
		return o.envErr
	}
	if net.ParseIP(o.BindAddress) == nil {
		return fmt.Errorf("--bind-address %q: want an IP address such as 0.0.0.0", o.BindAddress)
	}
	if o.Port < 0 || o.Port > 65535 {
		return fmt.Errorf("--port %d: want 1-65535 (or 0 for any free port)", o.Port)
	}
	if o.TLSCertFile == "" || o.TLSPrivateKeyFile == "" {
		return fmt.Errorf("--tls-cert-file and --tls-private-key-file are required: the API server only calls webhooks over HTTPS; mount a kubernetes.io/tls Secret (from cert-manager or made by hand) and point them at its tls.crt and tls.key")
	}
	return o.Addresses.Validate()
}
