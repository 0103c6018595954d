package metricsserver_test

import (
	"errors"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/klog/v2/ktesting"

	"github.com/tessera-dev/tessera/metricsserver"
)

// TestServesMetricsAndLiveness: /metrics shows the registry's metrics with
// the Go runtime's, /healthz follows the component's liveness.
func TestServesMetricsAndLiveness(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	reg := metricsserver.NewRegistry()
	counter := prometheus.NewCounter(prometheus.CounterOpts{Name: "tessera_test_total", Help: "A test counter."})
	reg.MustRegister(counter)
	counter.Add(3)
	var failure atomic.Pointer[error]
	s, err := metricsserver.Start(ctx, "--metrics-address", "127.0.0.1:0", reg, func() error {
		if e := failure.Load(); e != nil {
			return *e
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Stop()
	get := func(path string) (int, string) {
		t.Helper()
		resp, err := http.Get("http://" + s.Addr() + path)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = resp.Body.Close() }()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	if code, body := get("/metrics"); code != http.StatusOK || !strings.Contains(body, "tessera_test_total 3") || !strings.Contains(body, "go_goroutines") {
		t.Errorf("/metrics: %d, body lacks tessera_test_total 3 or go_goroutines:\n%s", code, body)
	}
	if code, _ := get("/healthz"); code != http.StatusOK {
		t.Errorf("/healthz while alive: %d, want 200", code)
	}
	stopped := errors.New("server stopped: address in use")
	failure.Store(&stopped)
	if code, body := get("/healthz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "address in use") {
		t.Errorf("/healthz after a failure: %d %q, want 503 with the cause", code, body)
	}
}

func TestStartNamesTheFlagWhenTheAddressIsTaken(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	reg := prometheus.NewRegistry()
	first, err := metricsserver.Start(ctx, "--metrics-address", "127.0.0.1:0", reg, func() error { return nil })
	if err != nil {
		t.Fatal(err)
	}
	defer first.Stop()
	if _, err := metricsserver.Start(ctx, "--metrics-address", first.Addr(), reg, func() error { return nil }); err == nil || !strings.Contains(err.Error(), "--metrics-address") {
		t.Errorf("second server on %s: got %v, want an error naming --metrics-address", first.Addr(), err)
	}
}
