package keypair_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"k8s.io/klog/v2/ktesting"

	"github.com/tessera-dev/tessera/webhook/keypair"
	"github.com/tessera-dev/tessera/webhook/webhooktest"
)

func TestNewRefusesAMissingOrBrokenPair(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	ca := webhooktest.NewCA(t)
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	if _, err := keypair.New(ctx, certFile, keyFile); err == nil || !strings.Contains(err.Error(), "tls.crt") {
		t.Errorf("missing files: got %v, want an error naming tls.crt", err)
	}
	_, certPEM, _ := ca.Issue(t, "127.0.0.1")
	_, _, otherKeyPEM := ca.Issue(t, "127.0.0.1")
	write(t, certFile, certPEM)
	write(t, keyFile, otherKeyPEM)
	if _, err := keypair.New(ctx, certFile, keyFile); err == nil || !strings.Contains(err.Error(), "belong together") {
		t.Errorf("mismatched pair: got %v, want an error saying they must belong together", err)
	}
}

// TestRewrittenInPlaceIsReloaded: files overwritten where they are (not
// swapped in through a symlink) are picked up at the next handshake.
func TestRewrittenInPlaceIsReloaded(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	ca := webhooktest.NewCA(t)
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	first, certPEM, keyPEM := ca.Issue(t, "127.0.0.1")
	write(t, certFile, certPEM)
	write(t, keyFile, keyPEM)
	r, err := keypair.New(ctx, certFile, keyFile)
	if err != nil {
		t.Fatal(err)
	}
	serial := func() string {
		c, err := r.GetCertificate(nil)
		if err != nil || c == nil {
			t.Fatalf("GetCertificate: %v, %v", c, err)
		}
		return c.Leaf.SerialNumber.String()
	}
	if got := serial(); got != first.SerialNumber.String() {
		t.Fatalf("serving %s, want %s", got, first.SerialNumber)
	}
	second, certPEM, keyPEM := ca.Issue(t, "127.0.0.1")
	write(t, keyFile, keyPEM)
	write(t, certFile, certPEM)
	if got := serial(); got != second.SerialNumber.String() {
		t.Fatalf("after rewriting the files serving %s, want %s", got, second.SerialNumber)
	}
}

func write(t *testing.T, path string, data []byte) {
	t.Helper()
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
}
