// Package webhooktest makes what a test of an admission webhook serves with:
// a throwaway certificate authority and serving certificates it signs,
// written the way a Secret volume presents them.
package webhooktest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

// CA signs serving certificates for one test.
type CA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	// PEM is the CA certificate, what a webhook configuration's caBundle
	// holds.
	PEM []byte

	mu     sync.Mutex
	serial int64
}

// NewCA creates a CA or fails the test.
func NewCA(t testing.TB) *CA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatalf("generate CA key: %v", err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "tessera-webhook-test-ca"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		t.Fatalf("create CA certificate: %v", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatalf("parse CA certificate: %v", err)
	}
	return &CA{cert: cert, key: key, serial: 1, PEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

// Pool is a certificate pool holding only the CA, for clients.
func (ca *CA) Pool() *x509.CertPool {
	pool := x509.NewCertPool()
	pool.AddCert(ca.cert)
	return pool
}

// Issue signs a serving certificate for hosts (IP addresses or DNS names)
// and returns it with its key, both PEM.
func (ca *CA) Issue(t testing.TB, hosts ...string) (cert *x509.Certificate, certPEM, keyPEM []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatalf("generate serving key: %v", err)
	}
	ca.mu.Lock()
	ca.serial++
	serial := ca.serial
	ca.mu.Unlock()
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial),
		Subject:      pkix.Name{CommonName: fmt.Sprintf("tessera-webhook-%d", serial)},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, key.Public(), ca.key)
	if err != nil {
		t.Fatalf("sign serving certificate: %v", err)
	}
	if cert, err = x509.ParseCertificate(der); err != nil {
		t.Fatalf("parse serving certificate: %v", err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatalf("encode serving key: %v", err)
	}
	return cert, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER})
}

// SecretVolume is a directory laid out as the kubelet presents a
// kubernetes.io/tls Secret: tls.crt and tls.key are symlinks into ..data,
// itself a symlink to a timestamped directory that an update replaces in one
// rename.
type SecretVolume struct {
	Dir      string
	versions int
}

// CertFile is the certificate file a webhook is pointed at.
func (v *SecretVolume) CertFile() string { return filepath.Join(v.Dir, "tls.crt") }

// KeyFile is the key file a webhook is pointed at.
func (v *SecretVolume) KeyFile() string { return filepath.Join(v.Dir, "tls.key") }

// NewSecretVolume writes a first serving certificate for hosts into dir.
func (ca *CA) NewSecretVolume(t testing.TB, dir string, hosts ...string) (*SecretVolume, *x509.Certificate) {
	t.Helper()
	v := &SecretVolume{Dir: dir}
	cert, certPEM, keyPEM := ca.Issue(t, hosts...)
	v.Write(t, certPEM, keyPEM)
	for _, name := range []string{"tls.crt", "tls.key"} {
		if err := os.Symlink(filepath.Join("..data", name), filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
	}
	return v, cert
}

// Rotate replaces both files at once with a new certificate for hosts, as
// the kubelet does when the Secret changes.
func (ca *CA) Rotate(t testing.TB, v *SecretVolume, hosts ...string) *x509.Certificate {
	t.Helper()
	cert, certPEM, keyPEM := ca.Issue(t, hosts...)
	v.Write(t, certPEM, keyPEM)
	return cert
}

// Write replaces both files at once with these PEM blocks, whether they
// belong together or not.
func (v *SecretVolume) Write(t testing.TB, certPEM, keyPEM []byte) {
	t.Helper()
	v.versions++
	version := fmt.Sprintf("..v%d", v.versions)
	if err := os.MkdirAll(filepath.Join(v.Dir, version), 0o700); err != nil {
		t.Fatal(err)
	}
	for name, data := range map[string][]byte{"tls.crt": certPEM, "tls.key": keyPEM} {
		if err := os.WriteFile(filepath.Join(v.Dir, version, name), data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	tmp := filepath.Join(v.Dir, "..data_tmp")
	if err := os.Symlink(version, tmp); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(v.Dir, "..data")); err != nil {
		t.Fatal(err)
	}
}
