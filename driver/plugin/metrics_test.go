package plugin_test

import (
	"io"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tessera-dev/tessera/driver/plugin"
)

// scrape GETs a path of the plugin's metrics server (10 s bound).
func scrape(t *testing.T, addr, path string) (int, string) {
	t.Helper()
	c := &http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get("http://" + addr + path)
	if err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	defer func() { _ = resp.Body.Close() }()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(body)
}

// wantLines fails unless every line is in the exposition text.
func wantLines(t *testing.T, body string, lines ...string) {
	t.Helper()
	have := map[string]bool{}
	for _, l := range strings.Split(body, "\n") {
		have[l] = true
	}
	for _, l := range lines {
		if !have[l] {
			t.Errorf("metrics lack %q", l)
		}
	}
}

// metricValue is the value of the sample named exactly name (no labels).
func metricValue(t *testing.T, body, name string) float64 {
	t.Helper()
	for _, l := range strings.Split(body, "\n") {
		if v, ok := strings.CutPrefix(l, name+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			return f
		}
	}
	t.Fatalf("metrics lack %s", name)
	return 0
}

func TestMetricsAreServedOnTheMetricsAddress(t *testing.T) {
	h := startHealth(t, "pcie-l4x4")
	if got := h.plugin.MetricsAddress(); got != "" {
		t.Errorf("metrics served at %q without --metrics-address", got)
	}
	h.opts.MetricsAddress = "127.0.0.1:0" // a free loopback port
	h.restart()
	addr := h.plugin.MetricsAddress()
	if !strings.HasPrefix(addr, "127.0.0.1:") || strings.HasSuffix(addr, ":0") {
		t.Fatalf("metrics address %q, want the loopback port chosen", addr)
	}
	if code, body := scrape(t, addr, "/healthz"); code != http.StatusOK {
		t.Errorf("/healthz: %d %s", code, body)
	}

	if err := h.node.InjectXID(1, 48); err != nil {
		t.Fatal(err)
	}
	h.awaitSlices("taint on gpu-1", func(m map[string][]string) bool { return len(m["gpu-1"]) > 0 })
	c := h.claim("train", "gpu-2")
	if _, errMsg := h.prepare(c); errMsg != "" {
		t.Fatal(errMsg)
	}
	if _, errMsg := h.prepare(h.claim("rival", "gpu-2")); errMsg == "" {
		t.Fatal("a second claim got gpu-2")
	}
	_, body := scrape(t, addr, "/metrics")
	wantLines(t, body,
		`tessera_device_healthy{gpu="gpu-0"} 1`,
		`tessera_device_healthy{gpu="gpu-1"} 0`,
		`tessera_prepare_total{result="success"} 1`,
		`tessera_prepare_total{result="error"} 1`,
		`tessera_prepare_duration_seconds_count 2`,
		`tessera_prepared_devices 1`,
		`tessera_prepares_in_flight 0`,
		`tessera_published_devices 4`, // the four L4s (no MIG on L4)
	)
	if !regexp.MustCompile(`(?m)^tessera_health_events_total\{gpu="gpu-1",kind="xid",uuid="GPU-[^"]+",xid="48"\} 1$`).MatchString(body) {
		t.Errorf("metrics lack the XID 48 event of gpu-1:\n%s", body)
	}
	writes := metricValue(t, body, "tessera_checkpoint_write_duration_seconds_count")
	if writes < 1 {
		t.Errorf("%v checkpoint writes after a prepare, want at least its completed mark", writes)
	}
	if resp, err := h.kubelet.Unprepare(h.ctx, c); err != nil || resp.Claims[string(c.UID)].Error != "" {
		t.Fatalf("unprepare: %v %v", resp, err)
	}
	_, body = scrape(t, addr, "/metrics")
	wantLines(t, body, `tessera_unprepare_total{result="success"} 1`, `tessera_unprepare_duration_seconds_count 1`, `tessera_prepared_devices 0`)
	// The unprepare of a whole GPU with nothing to undo but its spec is
	// one checkpointed move: gone.
	if got := metricValue(t, body, "tessera_checkpoint_write_duration_seconds_count") - writes; got != 1 {
		t.Errorf("an unprepare made %v checkpoint writes, want 1", got)
	}

	// Stopped with the plugin.
	h.plugin.Stop()
	if _, err := (&http.Client{Timeout: 10 * time.Second}).Get("http://" + addr + "/metrics"); err == nil {
		t.Error("metrics still served after Stop")
	}
}

func TestMetricsAddressMustBeHostPort(t *testing.T) {
	for _, tc := range []struct {
		addr string
		ok   bool
	}{{"", true}, {":8080", true}, {"127.0.0.1:9400", true}, {"8080", false}, {"localhost", false}} {
		o := plugin.Options{CDIRoot: "/c", PluginDataDir: "/p", RegistrarDir: "/r", KubeAPIQPS: 1, KubeAPIBurst: 1}
		o.MetricsAddress = tc.addr
		o.Node.NodeName = nodeName
		o.Node.FakeNode = "pcie-l4x4"
		err := o.Validate()
		if (err == nil) != tc.ok {
			t.Errorf("--metrics-address %q: error %v, want ok=%v", tc.addr, err, tc.ok)
		}
	}
}
