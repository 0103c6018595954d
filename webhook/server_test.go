package webhook_test

import (
	"crypto/tls"
	"encoding/json"
	"net/http"
	"os"
	"strings"
	"testing"

	admissionv1 "k8s.io/api/admission/v1"

	driverslices "github.com/tessera-dev/tessera/driver/slices"
	"github.com/tessera-dev/tessera/webhook"
)

// TestServesRotatedCertificate replaces the serving certificate the way a
// Secret volume does and checks that the next connection gets the new one;
// a half-written rotation (new certificate, old key) keeps the previous
// certificate in service until the key arrives too.
func TestServesRotatedCertificate(t *testing.T) {
	s := startServer(t)
	served := func() string {
		t.Helper()
		conn, err := tls.Dial("tcp", s.srv.Addr(), &tls.Config{RootCAs: s.ca.Pool()})
		if err != nil {
			t.Fatalf("TLS handshake: %v", err)
		}
		defer func() { _ = conn.Close() }()
		return conn.ConnectionState().PeerCertificates[0].SerialNumber.String()
	}
	first := served()

	rotated := s.ca.Rotate(t, s.volume, "127.0.0.1")
	if got := served(); got != rotated.SerialNumber.String() {
		t.Fatalf("after rotation serial %s is served, want the new %s (first was %s)", got, rotated.SerialNumber, first)
	}

	// A pair that does not belong together (a bad Secret, or files written
	// one at a time and caught half-way): the new certificate, the old key.
	oldKeyPEM, err := os.ReadFile(s.volume.KeyFile())
	if err != nil {
		t.Fatal(err)
	}
	next, nextCertPEM, nextKeyPEM := s.ca.Issue(t, "127.0.0.1")
	s.volume.Write(t, nextCertPEM, oldKeyPEM)
	if got := served(); got != rotated.SerialNumber.String() {
		t.Fatalf("with a mismatched pair on disk serial %s is served, want the previous %s", got, rotated.SerialNumber)
	}
	s.volume.Write(t, nextCertPEM, nextKeyPEM)
	if got := served(); got != next.SerialNumber.String() {
		t.Fatalf("once the pair is whole again serial %s is served, want %s", got, next.SerialNumber)
	}

	// Reviews still work over the new certificate, on a new connection.
	s.client.CloseIdleConnections()
	body, _ := json.Marshal(request{op: admissionv1.Create, obj: claim()}.review(t, "after-rotation"))
	if code, out := s.post(t, http.MethodPost, body); code != http.StatusOK {
		t.Fatalf("review after rotation: HTTP %d %s", code, out)
	}
}

// TestDriverNameIsThePlugins: the webhook reviews the configurations the
// plugin reads.
func TestDriverNameIsThePlugins(t *testing.T) {
	if webhook.DriverName != driverslices.DriverName {
		t.Errorf("webhook reviews %q, the plugin is %q", webhook.DriverName, driverslices.DriverName)
	}
}

func TestOptionsValidate(t *testing.T) {
	valid := webhook.Options{BindAddress: "0.0.0.0", Port: 8443, TLSCertFile: "tls.crt", TLSPrivateKeyFile: "tls.key"}
	if err := valid.Validate(); err != nil {
		t.Fatalf("valid options: %v", err)
	}
	for name, tc := range map[string]struct {
		mutate func(o *webhook.Options)
		want   string
	}{
		"no certificate": {func(o *webhook.Options) { o.TLSCertFile = "" }, "--tls-cert-file"},
		"no key":         {func(o *webhook.Options) { o.TLSPrivateKeyFile = "" }, "--tls-private-key-file"},
		"bad address":    {func(o *webhook.Options) { o.BindAddress = "localhost" }, "--bind-address"},
		"bad port":       {func(o *webhook.Options) { o.Port = 70000 }, "--port"},
		"bad metrics":    {func(o *webhook.Options) { o.MetricsAddress = "8080" }, "--metrics-address"},
	} {
		o := valid
		tc.mutate(&o)
		if err := o.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: got %v, want an error naming %s", name, err, tc.want)
		}
	}
}
