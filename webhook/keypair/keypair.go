// Package keypair serves a TLS certificate and key from files and picks up
// new ones when the files change (a Secret volume update, cert-manager
// renewing the certificate), without a restart.
package keypair

import (
	"context"
	"crypto/tls"
	"fmt"
	"os"
	"sync"

	"k8s.io/klog/v2"
)

// Reloader hands out the certificate in its files, for tls.Config's
// GetCertificate. It looks at the files at each TLS handshake, not on a
// timer: a stat of two files is cheap next to a handshake, and a rotation is
// seen by the very next connection. When the new files do not load (a
// rotation caught half-written: new certificate, old key) it keeps serving
// the previous pair and tries again once the files change once more.
type Reloader struct {
	certFile, keyFile string
	logger            klog.Logger

	mu        sync.Mutex
	cert      *tls.Certificate
	certInfo  os.FileInfo // the files as last looked at
	keyInfo   os.FileInfo
	lastError string // logged once, not at every handshake
}

// New loads the pair once and fails when it cannot: a server must not start
// without a certificate.
func New(ctx context.Context, certFile, keyFile string) (*Reloader, error) {
	r := &Reloader{certFile: certFile, keyFile: keyFile, logger: klog.FromContext(ctx)}
	if err := r.reloadIfChanged(); err != nil {
		return nil, err
	}
	return r, nil
}

// GetCertificate returns the current certificate, first loading the files
// again if they changed since they were last looked at.
func (r *Reloader) GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.reloadIfChanged(); err != nil && err.Error() != r.lastError {
		r.logger.Error(err, "Serving the previous certificate until the files change again")
		r.lastError = err.Error()
	}
	return r.cert, nil
}

// reloadIfChanged loads the pair when either file differs from when it was
// last looked at. Callers hold mu (or own r exclusively).
func (r *Reloader) reloadIfChanged() error {
	certInfo, err := os.Stat(r.certFile)
	if err != nil {
		return fmt.Errorf("serving certificate: %w", err)
	}
	keyInfo, err := os.Stat(r.keyFile)
	if err != nil {
		return fmt.Errorf("serving key: %w", err)
	}
	if unchanged(r.certInfo, certInfo) && unchanged(r.keyInfo, keyInfo) {
		return nil
	}
	// Remember what was looked at even when it fails to load, so that a
	// broken pair is retried when the files change, not at every handshake.
	r.certInfo, r.keyInfo = certInfo, keyInfo
	pair, err := tls.LoadX509KeyPair(r.certFile, r.keyFile)
	if err != nil {
		return fmt.Errorf("load serving certificate %s and key %s: %w; they must be PEM and belong together", r.certFile, r.keyFile, err)
	}
	r.cert, r.lastError = &pair, ""
	if leaf := pair.Leaf; leaf != nil { // filled by Go unless GODEBUG x509keypairleaf=0
		r.logger.Info("Loaded serving certificate", "certFile", r.certFile,
			"subject", leaf.Subject.String(), "serial", leaf.SerialNumber.String(), "notAfter", leaf.NotAfter)
	}
	return nil
}

// unchanged says whether a file looks the same as before: same inode (a
// Secret volume swaps in new files through a symlink, and os.Stat follows
// it), size and modification time (an in-place rewrite).
func unchanged(before, now os.FileInfo) bool {
	return before != nil && os.SameFile(before, now) && before.Size() == now.Size() && before.ModTime().Equal(now.ModTime())
}
