// Package componenttest gives tests of the components' API clients an API
// server that misbehaves: one that accepts requests and never answers.
package componenttest

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
)

// HungAPIServer starts an API server that accepts every request and never
// answers, until the test ends, and returns a kubeconfig pointing at it.
func HungAPIServer(t testing.TB) (kubeconfig string) {
	t.Helper()
	done := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) {
		select {
		case <-done:
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(srv.Close)
	t.Cleanup(func() { close(done) }) // first: Close waits for the handlers
	return Kubeconfig(t, srv.URL)
}

// Kubeconfig writes a kubeconfig for an API server at url, without
// credentials, and returns its path.
func Kubeconfig(t testing.TB, url string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "kubeconfig")
	cfg := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: %q}}]
users: [{name: u, user: {}}]
contexts: [{name: c, context: {cluster: c, user: u}}]
current-context: c
`, url)
	if err := os.WriteFile(path, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}
