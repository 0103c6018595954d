package main

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// everyFigure renders go test -json output in which every figure of the
// report is present and meets its goal, except the values in override
// (key, or key-n for its sample count).
func everyFigure(t *testing.T, override map[string]float64) string {
	return figuresOf(t, figures, override)
}

// figuresOf is everyFigure for the figures of figs alone.
func figuresOf(t *testing.T, figs []figure, override map[string]float64) string {
	t.Helper()
	byBench := map[string][]string{}
	var order []string
	for _, f := range figs {
		v := 1.0
		if f.Goal != nil {
			v = f.Goal.Value
			if f.Goal.Op == "<" {
				v--
			}
		}
		if o, ok := override[f.Key]; ok {
			v = o
		}
		if _, ok := byBench[f.Benchmark]; !ok {
			order = append(order, f.Benchmark)
		}
		byBench[f.Benchmark] = append(byBench[f.Benchmark], strconv.FormatFloat(v, 'f', -1, 64)+" "+f.Metric)
		if f.Goal != nil && f.Goal.MinSamples > 0 {
			n := float64(f.Goal.MinSamples)
			if o, ok := override[f.Key+"-n"]; ok {
				n = o
			}
			byBench[f.Benchmark] = append(byBench[f.Benchmark], strconv.FormatFloat(n, 'f', -1, 64)+" "+f.Metric+"-n",
				strconv.FormatFloat(v*0.9, 'f', -1, 64)+" "+f.Metric+"-lo", strconv.FormatFloat(v*1.1, 'f', -1, 64)+" "+f.Metric+"-hi")
		}
	}
	var lines []string
	for _, b := range order {
		lines = append(lines, fmt.Sprintf("%s-2 \t 1\t 100 ns/op\t %s", b, strings.Join(byBench[b], "\t ")))
	}
	return stream("example.com/bench", append(lines, "PASS")...)
}

// report runs benchreport on in and returns what it printed and its error.
func report(t *testing.T, in string, flags ...string) (string, error) {
	t.Helper()
	dir := t.TempDir()
	src := filepath.Join(dir, "bench.json")
	if err := os.WriteFile(src, []byte(in), 0o644); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	err := run(append(append([]string{"-o", filepath.Join(dir, "report.json")}, flags...), src), &out)
	return out.String(), err
}

func TestEveryGoalMetPasses(t *testing.T) {
	if out, err := report(t, everyFigure(t, nil)); err != nil {
		t.Fatalf("every goal met: %v\n%s", err, out)
	}
}

func TestAMissedGoalFailsAfterPrintingEveryFigure(t *testing.T) {
	out, err := report(t, everyFigure(t, map[string]float64{"publish_ms": 5267}))
	if err == nil {
		t.Fatalf("publish_ms 5267 against < 500: no error\n%s", out)
	}
	if !strings.Contains(err.Error(), "publish_ms") {
		t.Errorf("error %q does not name publish_ms", err)
	}
	// Every figure printed, the missed one marked.
	for _, f := range figures {
		if !strings.Contains(out, f.Key) {
			t.Errorf("%s not printed before failing", f.Key)
		}
	}
	if !strings.Contains(out, "NOT MET") {
		t.Errorf("the table does not mark the missed goal:\n%s", out)
	}
}

func TestAGoalJudgedOnTooFewSamplesFails(t *testing.T) {
	out, err := report(t, everyFigure(t, map[string]float64{"publish_ms-n": 3}))
	if err == nil || !strings.Contains(err.Error(), "publish_ms") {
		t.Fatalf("publish_ms of 3 samples against n >= 9: error %v\n%s", err, out)
	}
	if !strings.Contains(out, "TOO FEW SAMPLES (BenchmarkPublish reported 3 samples; the goal is judged on at least 9)") {
		t.Errorf("the table does not say why publish_ms is not judged:\n%s", out)
	}
}

func TestSamplesAndSpreadAreReported(t *testing.T) {
	in := stream("example.com/bench",
		"BenchmarkPublish-2 \t 9\t 1 ns/op\t 310 ms/publish\t 9 ms/publish-n\t 280 ms/publish-lo\t 420 ms/publish-hi\t 47.5 MiB/rss",
		"PASS")
	r := newResults()
	if err := r.parse(strings.NewReader(in)); err != nil {
		t.Fatal(err)
	}
	e := build(r, figures)
	p := e["publish_ms"]
	if p.N == nil || *p.N != 9 || p.Spread == nil || *p.Spread != [2]float64{280, 420} || p.Status != statusMet {
		t.Errorf("publish_ms = %+v, want 310 of 9 samples, spread 280–420, met", p)
	}
	if m := e["plugin_rss_mib"]; m.N != nil || m.Spread != nil || m.Status != statusFewSamples {
		t.Errorf("plugin_rss_mib = %+v, want no count or spread, not judged", m)
	}
}

func TestTheShortSubsetJudgesOnlyItsFigures(t *testing.T) {
	short := shortFigures()
	var keys []string
	for _, f := range short {
		keys = append(keys, f.Key)
	}
	want := []string{"prepare_vs_floor", "publish_vs_floor", "plugin_rss_mib", "gang_256_vs_plain"}
	if strings.Join(keys, " ") != strings.Join(want, " ") {
		t.Errorf("short subset %v, want %v", keys, want)
	}
	// Only the short benchmarks ran: the short report passes, the full
	// one fails on every other figure missing.
	// The short figures' benchmarks report everything they report in full.
	var ran []figure
	for _, f := range figures {
		for _, g := range short {
			if f.Benchmark == g.Benchmark {
				ran = append(ran, f)
				break
			}
		}
	}
	in := figuresOf(t, ran, nil)
	if out, err := report(t, in, "-short"); err != nil {
		t.Errorf("short subset: %v\n%s", err, out)
	}
	if _, err := report(t, in); err == nil || !strings.Contains(err.Error(), "missing") {
		t.Errorf("full report of the short benchmarks alone: %v, want figures missing", err)
	}
	out, err := report(t, everyFigure(t, map[string]float64{"gang_256_vs_plain": 4.5}), "-short")
	if err == nil || !strings.Contains(err.Error(), "1 of 4 figures") || !strings.Contains(err.Error(), "gang_256_vs_plain") {
		t.Errorf("short subset with gang_256_vs_plain 4.5 against <= 3: %v\n%s", err, out)
	}
}
