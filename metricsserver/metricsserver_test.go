package metricsserver_test

import (
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/pflag"
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
	s, err := metricsserver.Start(ctx, metricsserver.Addresses{MetricsAddress: "127.0.0.1:0"}, reg, func() error {
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
	first, err := metricsserver.Start(ctx, metricsserver.Addresses{MetricsAddress: "127.0.0.1:0"}, reg, func() error { return nil })
	if err != nil {
		t.Fatal(err)
	}
	defer first.Stop()
	if _, err := metricsserver.Start(ctx, metricsserver.Addresses{MetricsAddress: first.Addr()}, reg, func() error { return nil }); err == nil || !strings.Contains(err.Error(), "--metrics-address") {
		t.Errorf("second server on %s: got %v, want an error naming --metrics-address", first.Addr(), err)
	}
	if _, err := metricsserver.Start(ctx, metricsserver.Addresses{MetricsAddress: "127.0.0.1:0", HealthAddress: first.Addr()}, reg, func() error { return nil }); err == nil || !strings.Contains(err.Error(), "--health-address") {
		t.Errorf("health server on %s: got %v, want an error naming --health-address", first.Addr(), err)
	}
}

// parse parses args as a component does and returns the addresses.
func parse(t *testing.T, args ...string) metricsserver.Addresses {
	t.Helper()
	var a metricsserver.Addresses
	fs := pflag.NewFlagSet("test", pflag.ContinueOnError)
	a.AddFlags(fs)
	if err := fs.Parse(args); err != nil {
		t.Fatal(err)
	}
	if err := a.Validate(); err != nil {
		t.Fatal(err)
	}
	return a
}

// withPort0 is addr with port 0, so that a test never depends on the
// default port being free.
func withPort0(t *testing.T, addr string) string {
	t.Helper()
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatal(err)
	}
	return net.JoinHostPort(host, "0")
}

// externalIP is an address of this machine other than loopback, or nil.
func externalIP(t *testing.T) net.IP {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && n.IP.To4() != nil && !n.IP.IsLoopback() && !n.IP.IsLinkLocalUnicast() {
			return n.IP
		}
	}
	return nil
}

// reachable reports whether a TCP connection to ip at addr's port succeeds.
func reachable(t *testing.T, ip net.IP, addr string) bool {
	t.Helper()
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatal(err)
	}
	c, err := net.DialTimeout("tcp", net.JoinHostPort(ip.String(), port), 2*time.Second)
	if err != nil {
		return false
	}
	_ = c.Close()
	return true
}

// TestMetricsListenOnLoopbackByDefault: without flags or environment,
// /metrics is served on the loopback interface only (another of the
// machine's addresses is refused), and no separate liveness listener opens.
func TestMetricsListenOnLoopbackByDefault(t *testing.T) {
	t.Setenv("METRICS_ADDRESS", "")
	t.Setenv("HEALTH_ADDRESS", "")
	a := parse(t)
	if a.MetricsAddress != metricsserver.DefaultMetricsAddress || a.HealthAddress != "" {
		t.Fatalf("defaults: --metrics-address %q --health-address %q, want %q and empty", a.MetricsAddress, a.HealthAddress, metricsserver.DefaultMetricsAddress)
	}
	_, ctx := ktesting.NewTestContext(t)
	a.MetricsAddress = withPort0(t, a.MetricsAddress)
	s, err := metricsserver.Start(ctx, a, prometheus.NewRegistry(), func() error { return nil })
	if err != nil {
		t.Fatal(err)
	}
	defer s.Stop()
	host, _, _ := net.SplitHostPort(s.Addr())
	if ip := net.ParseIP(host); ip == nil || !ip.IsLoopback() {
		t.Errorf("metrics served at %s by default, want a loopback address", s.Addr())
	}
	if !reachable(t, net.IPv4(127, 0, 0, 1), s.Addr()) {
		t.Errorf("metrics at %s not reachable on loopback", s.Addr())
	}
	if ip := externalIP(t); ip == nil {
		t.Log("this machine has no address besides loopback; not checked from another interface")
	} else if reachable(t, ip, s.Addr()) {
		t.Errorf("metrics at %s are reachable on %s by default", s.Addr(), ip)
	}
	if s.HealthAddr() != "" {
		t.Errorf("a liveness listener at %s by default, want none", s.HealthAddr())
	}
}

// TestExplicitAddressesAreHonoured: --metrics-address and --health-address
// (or their environment) open what they name; the liveness listener serves
// /healthz and not /metrics.
func TestExplicitAddressesAreHonoured(t *testing.T) {
	t.Setenv("HEALTH_ADDRESS", "")
	t.Setenv("METRICS_ADDRESS", "0.0.0.0:9400")
	if a := parse(t); a.MetricsAddress != "0.0.0.0:9400" {
		t.Errorf("METRICS_ADDRESS=0.0.0.0:9400: --metrics-address %q", a.MetricsAddress)
	}
	a := parse(t, "--metrics-address=0.0.0.0:0", "--health-address=:0")
	if a.MetricsAddress != "0.0.0.0:0" || a.HealthAddress != ":0" {
		t.Fatalf("parsed %+v, want 0.0.0.0:0 and :0 (flags win over the environment)", a)
	}
	_, ctx := ktesting.NewTestContext(t)
	s, err := metricsserver.Start(ctx, a, prometheus.NewRegistry(), func() error { return nil })
	if err != nil {
		t.Fatal(err)
	}
	defer s.Stop()
	if s.Addr() == s.HealthAddr() {
		t.Fatalf("metrics and liveness share %s, want a listener each", s.Addr())
	}
	if ip := externalIP(t); ip != nil && (!reachable(t, ip, s.Addr()) || !reachable(t, ip, s.HealthAddr())) {
		t.Errorf("--metrics-address and --health-address 0.0.0.0 are not reachable on %s", ip)
	}
	for path, want := range map[string]int{"/healthz": http.StatusOK, "/metrics": http.StatusNotFound} {
		resp, err := http.Get("http://" + s.HealthAddr() + path)
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		if resp.StatusCode != want {
			t.Errorf("%s on --health-address: %d, want %d", path, resp.StatusCode, want)
		}
	}
	same, err := metricsserver.Start(ctx, metricsserver.Addresses{MetricsAddress: "127.0.0.1:0", HealthAddress: "127.0.0.1:0"}, prometheus.NewRegistry(), func() error { return nil })
	if err != nil {
		t.Fatal(err)
	}
	defer same.Stop()
	if same.Addr() != same.HealthAddr() {
		t.Errorf("the same address for both: metrics at %s, liveness at %s; want one listener", same.Addr(), same.HealthAddr())
	}
	if err := (&metricsserver.Addresses{HealthAddress: "8081"}).Validate(); err == nil || !strings.Contains(err.Error(), "--health-address") {
		t.Errorf("--health-address 8081: got %v, want an error naming the flag", err)
	}
}

// TestNothingIsServedWithoutAddresses: both flags empty serve nothing.
func TestNothingIsServedWithoutAddresses(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	s, err := metricsserver.Start(ctx, metricsserver.Addresses{}, prometheus.NewRegistry(), func() error { return nil })
	if err != nil || s != nil {
		t.Errorf("Start without addresses: %v, %v; want nothing served", s, err)
	}
	s.Stop()
}

// TestReadinessNeedsBothProbes: /readyz says ok only while the component is
// alive and ready, and says why not otherwise; /healthz ignores readiness.
func TestReadinessNeedsBothProbes(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	var notReady, dead atomic.Pointer[error]
	probe := func(p *atomic.Pointer[error]) func() error {
		return func() error {
			if e := p.Load(); e != nil {
				return *e
			}
			return nil
		}
	}
	s, err := metricsserver.StartProbes(ctx, metricsserver.Addresses{MetricsAddress: "127.0.0.1:0", HealthAddress: "127.0.0.1:0"}, prometheus.NewRegistry(),
		metricsserver.Probes{Alive: probe(&dead), Ready: probe(&notReady)})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Stop()
	get := func(addr, path string) (int, string) {
		t.Helper()
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = resp.Body.Close() }()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	waiting := errors.New("not registered with the kubelet yet")
	notReady.Store(&waiting)
	for _, addr := range []string{s.Addr(), s.HealthAddr()} {
		if code, body := get(addr, "/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "not registered") {
			t.Errorf("%s/readyz while not ready: %d %q, want 503 with the reason", addr, code, body)
		}
		if code, _ := get(addr, "/healthz"); code != http.StatusOK {
			t.Errorf("%s/healthz while alive but not ready: %d, want 200", addr, code)
		}
	}
	notReady.Store(nil)
	if code, _ := get(s.HealthAddr(), "/readyz"); code != http.StatusOK {
		t.Errorf("/readyz while alive and ready: %d, want 200", code)
	}
	gone := errors.New("lost the API server")
	dead.Store(&gone)
	if code, body := get(s.HealthAddr(), "/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "lost the API server") {
		t.Errorf("/readyz while dead: %d %q, want 503 with the cause", code, body)
	}
}
