package main

import (
	"encoding/json"
	"strings"
	"testing"
)

// stream renders lines as go test -json output events of one package, each
// line possibly split over two events as test2json may do.
func stream(pkg string, lines ...string) string {
	var b strings.Builder
	for _, l := range lines {
		test := ""
		if strings.HasPrefix(l, "--- FAIL: ") {
			test = strings.Fields(l)[2]
		}
		half := len(l) / 2
		for _, part := range []string{l[:half], l[half:] + "\n"} {
			raw, _ := json.Marshal(event{Action: "output", Package: pkg, Test: test, Output: part})
			b.Write(append(raw, '\n'))
		}
	}
	return b.String()
}

func TestResultsAreReadFromSplitAndInterleavedLines(t *testing.T) {
	in := stream("example.com/bench",
		"goos: linux",
		"BenchmarkPrepare-2   \t       3\t5380735484 ns/op\t         6.113 ms/floor-p50\t        10.89 ms/p50\t         1.782 x/floor",
		// A benchmark's name, then another component's log line, then its figures.
		"BenchmarkPublish-2   \tI1130 14:36:43.883972   22219 run.go:83] \"Discovered GPUs\" count=8",
		"       3\t1600411069 ns/op\t        69.57 MiB/rss\t      1600 ms/publish",
		"BenchmarkGangPlacement/pods=256-2 \t 1\t 9000000000 ns/op\t 8.5 gang_256_s",
		"PASS",
	)
	r := newResults()
	if err := r.parse(strings.NewReader(in)); err != nil {
		t.Fatal(err)
	}
	want := map[string]map[string]float64{
		"BenchmarkPrepare":                {"ns/op": 5380735484, "ms/floor-p50": 6.113, "ms/p50": 10.89, "x/floor": 1.782},
		"BenchmarkPublish":                {"ns/op": 1600411069, "MiB/rss": 69.57, "ms/publish": 1600},
		"BenchmarkGangPlacement/pods=256": {"ns/op": 9000000000, "gang_256_s": 8.5},
	}
	for name, metrics := range want {
		for unit, v := range metrics {
			if got, ok := r.metrics[name][unit]; !ok || got != v {
				t.Errorf("%s %s = %v (present %v), want %v", name, unit, got, ok, v)
			}
		}
	}
	e := build(r, figures)
	if v := e["prepare_p50_ms"]; v.Value == nil || *v.Value != 10.89 || v.Status != statusNoGoal {
		t.Errorf("prepare_p50_ms = %+v, want 10.89 without a goal", v)
	}
	// Goals judged on a number of samples are not judged without a count.
	if v := e["prepare_vs_floor"]; v.Value == nil || v.Met != nil || v.Status != statusFewSamples || v.Goal != "<= 2 (n >= 600)" {
		t.Errorf("prepare_vs_floor = %+v, want 1.782 not judged: no sample count", v)
	}
	if v := e["gang_256_s"]; v.Value == nil || !*v.Met || v.Status != statusMet {
		t.Errorf("gang_256_s = %+v, want 8.5 meeting < 10", v)
	}
}

func TestAFailedBenchmarkLeavesItsFiguresNullWithTheReason(t *testing.T) {
	in := stream("example.com/e2e",
		"BenchmarkGangPlacement/pods=256-2 \t",
		"    gang_bench_test.go:97: 200 of 256 pods bound after 5m0s",
		"--- FAIL: BenchmarkGangPlacement/pods=256-2",
		"FAIL",
	)
	r := newResults()
	if err := r.parse(strings.NewReader(in)); err != nil {
		t.Fatal(err)
	}
	e := build(r, figures)["gang_256_s"]
	if e.Value != nil || e.Met != nil {
		t.Fatalf("gang_256_s = %+v, want no value", e)
	}
	if !strings.Contains(e.Error, "BenchmarkGangPlacement/pods=256 failed") || !strings.Contains(e.Error, "200 of 256 pods bound") {
		t.Errorf("error = %q, want the failure and its output", e.Error)
	}
	if e := build(r, figures)["publish_ms"]; e.Value != nil || !strings.Contains(e.Error, "did not run") {
		t.Errorf("publish_ms = %+v, want did not run", e)
	}
}

func TestSchedulerFiguresAreKeyedByCaseAndNodeCount(t *testing.T) {
	in := stream("example.com/e2e",
		"BenchmarkSchedulerThroughput/nodes=500/case=mig1g-2 \t 1\t 53642351932 ns/op\t 75.85 cpu-ms/pod\t 88.94 ms/algorithm\t 24485 ms/p50\t 52079 ms/p99\t 11.19 pods/s\t 0 throttling-lines\t 0.2344 x/whole",
		"PASS",
	)
	r := newResults()
	if err := r.parse(strings.NewReader(in)); err != nil {
		t.Fatal(err)
	}
	e := build(r, figures)
	for key, want := range map[string]float64{
		"sched_pods_per_s_mig1g_500": 11.19, "sched_cpu_ms_per_pod_mig1g_500": 75.85,
		"sched_p50_ms_mig1g_500": 24485, "sched_p99_ms_mig1g_500": 52079, "sched_mig1g_vs_whole_500": 0.2344,
	} {
		if v := e[key]; v.Value == nil || *v.Value != want {
			t.Errorf("%s = %+v, want %v", key, v, want)
		}
	}
	if v := e["sched_mig1g_vs_whole_500"]; v.Met == nil || *v.Met || v.Goal != ">= 0.5" {
		t.Errorf("sched_mig1g_vs_whole_500 = %+v, want the goal >= 0.5 not met", v)
	}
	if _, ok := e["sched_whole_vs_whole_500"]; ok {
		t.Error("the whole case has a ratio to itself")
	}
}
