package main

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// The testdata/*.json streams are real `go test -json` output of the
// packages in testdata/fix (module example.com/fix), Go 1.26:
//
//	go test -json -count=1 ./ok ./fails ./broken > mixed.json
//	go test -json -count=1 -timeout 2s ./hangs > timeout.json
//	go test -json -count=1 ./ok > ok.json

func load(t *testing.T, names ...string) []*stream {
	t.Helper()
	var runs []*stream
	for _, name := range names {
		f, err := os.Open(filepath.Join("testdata", name+".json"))
		if err != nil {
			t.Fatal(err)
		}
		rn, err := read(name, f)
		_ = f.Close()
		if err != nil {
			t.Fatal(err)
		}
		runs = append(runs, rn)
	}
	return runs
}

func render(runs []*stream, o options) (string, bool) {
	o.trim = "example.com/fix/"
	var b strings.Builder
	ok := report(&b, runs, o)
	return b.String(), ok
}

// failedList is the report's closing list of what failed, one entry a line.
func failedList(t *testing.T, out string) []string {
	t.Helper()
	_, list, found := strings.Cut(out, "\nFAILED:\n")
	if !found {
		t.Fatalf("no FAILED list in:\n%s", out)
	}
	var entries []string
	for _, l := range strings.Split(strings.TrimSpace(list), "\n") {
		entries = append(entries, strings.Join(strings.Fields(l), " "))
	}
	return entries
}

func TestAFailedSubtestIsNamedWithItsOwnOutput(t *testing.T) {
	out, ok := render(load(t, "mixed"), options{})
	if ok {
		t.Error("report says a run with failures passed")
	}
	section := regexp.MustCompile(`(?s)=== FAIL: TestPlacement/ControllerKilledMidPlacement/crash \([0-9.]+s\) in fails \[mixed\]\n(.*?)\n\n`).FindStringSubmatch(out)
	if section == nil {
		t.Fatalf("no section for the failed subtest in:\n%s", out)
	}
	for _, want := range []string{"cluster logs in /tmp/x", "member 3 never bound", "--- FAIL: TestPlacement/ControllerKilledMidPlacement/crash"} {
		if !strings.Contains(section[1], want) {
			t.Errorf("the failed subtest's section lacks %q:\n%s", want, section[1])
		}
	}
	if strings.Contains(section[1], "placed 8 of 8") {
		t.Errorf("the failed subtest's section holds a passing sibling's output:\n%s", section[1])
	}
	// The package's own output (TestMain's) is shown too.
	if !strings.Contains(out, "main: clusters ready") {
		t.Errorf("the failed package's output outside its tests is missing:\n%s", out)
	}
	// The list names the deepest failed subtest, not its failed parents, and
	// the package whose build failed; passing tests are not in it.
	got := failedList(t, out)
	want := []string{"mixed fails TestPlacement/ControllerKilledMidPlacement/crash", "mixed broken [build failed]"}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("FAILED list:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

func TestABuildFailureShowsTheCompilerOutput(t *testing.T) {
	out, _ := render(load(t, "mixed"), options{})
	for _, want := range []string{"FAIL  broken  [build failed]", "=== BUILD FAILED: broken [mixed]", "broken/broken_test.go:5:28: undefined: undefined"} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q:\n%s", want, out)
		}
	}
}

func TestATimeoutNamesTheSubtestThatDidNotFinish(t *testing.T) {
	runs := load(t, "timeout")
	out, ok := render(runs, options{})
	if ok {
		t.Error("report says a timed-out run passed")
	}
	section := regexp.MustCompile(`(?s)=== DID NOT FINISH: TestWaits/ForeverOnATimer \(([0-9.]+)s\) in hangs \[timeout\]\n(.*?)\n=== `).FindStringSubmatch(out)
	if section == nil {
		t.Fatalf("no section for the unfinished subtest in:\n%s", out)
	}
	if section[1] != "2.0" {
		t.Errorf("the unfinished subtest ran %ss by the report, want 2.0 (its start to the package's end)", section[1])
	}
	for _, want := range []string{"waiting", "panic: test timed out after 2s", "TestWaits/ForeverOnATimer (2s)"} {
		if !strings.Contains(section[2], want) {
			t.Errorf("the unfinished subtest's section lacks %q:\n%s", want, section[2])
		}
	}
	if got := failedList(t, out); len(got) != 1 || got[0] != "timeout hangs TestWaits/ForeverOnATimer (did not finish)" {
		t.Errorf("FAILED list: %q", got)
	}
	if !strings.Contains(out, "3 tests and subtests: 1 passed, 0 failed, 0 skipped, 2 did not finish") {
		t.Errorf("counts wrong:\n%s", out)
	}
}

func TestAPassingRunSaysSoAndCountsEveryTest(t *testing.T) {
	out, ok := render(load(t, "ok"), options{})
	if !ok {
		t.Errorf("report says a passing run failed:\n%s", out)
	}
	if strings.Contains(out, "FAIL") {
		t.Errorf("a passing run's report mentions FAIL:\n%s", out)
	}
	for _, want := range []string{"ok  ok  0.3s", "ok: ok; 1 package (0 without tests to run); 5 tests and subtests: 4 passed, 0 failed, 1 skipped"} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "quick one") {
		t.Errorf("a passing test's output is shown without -v:\n%s", out)
	}
	verbose, _ := render(load(t, "ok"), options{verbose: true})
	if !strings.Contains(verbose, "quick one") {
		t.Errorf("-v leaves out a passing test's output:\n%s", verbose)
	}
}

func TestTheSlowestTablesAreLongestFirstAndCut(t *testing.T) {
	out, _ := render(load(t, "timeout", "ok"), options{brief: true, slowest: 2})
	_, tables, _ := strings.Cut(out, "slowest packages:")
	want := []string{
		"seconds run name", "2.1 timeout hangs", "0.3 ok ok",
		"slowest tests:", "seconds run name", "2.0 timeout hangs TestWaits", "0.0 timeout hangs TestDone",
		"slowest subtests:", "seconds run name", "2.0 timeout hangs TestWaits/ForeverOnATimer", "0.2 ok ok TestSlow/second",
	}
	var got []string
	for _, l := range strings.Split(tables, "\n") {
		if f := strings.Fields(l); len(f) > 0 {
			got = append(got, strings.Join(f, " "))
		}
		if len(got) == len(want) {
			break
		}
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("tables:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	// -brief leaves out the failures' output but keeps their names.
	if strings.Contains(out, "panic: test timed out") {
		t.Errorf("-brief shows a failure's output:\n%s", out)
	}
	if got := failedList(t, out); len(got) != 1 || !strings.Contains(got[0], "TestWaits/ForeverOnATimer") {
		t.Errorf("-brief FAILED list: %q", got)
	}
}

func TestSplitOutputIsJoinedAndNonEventLinesAreKept(t *testing.T) {
	in := `go: downloading example.com/dep v1.0.0
{"Action":"start","Package":"p"}
{"Action":"run","Package":"p","Test":"TestA"}
{"Action":"output","Package":"p","Test":"TestA","Output":"    a_test.go:9: a long li"}
{"Action":"output","Package":"p","Test":"TestA","Output":"ne split in two\n"}
{"Action":"fail","Package":"p","Test":"TestA","Elapsed":1.5}
{"Action":"fail","Package":"p","Elapsed":1.6}
`
	rn, err := read("unit", strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	out, ok := render([]*stream{rn}, options{})
	if ok {
		t.Error("report says a failed run passed")
	}
	for _, want := range []string{"a_test.go:9: a long line split in two\n", "output of the go command, not of a test:\ngo: downloading example.com/dep v1.0.0"} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q:\n%s", want, out)
		}
	}
}

func TestAStreamCutShortFailsItsPackage(t *testing.T) {
	// What is left when go test is killed (CI's own time limit): the
	// package started and a test ran, but nothing ended.
	in := `{"Time":"2026-12-04T10:00:00Z","Action":"start","Package":"p"}
{"Time":"2026-12-04T10:00:01Z","Action":"run","Package":"p","Test":"TestLong"}
{"Time":"2026-12-04T10:05:01Z","Action":"output","Package":"p","Test":"TestLong","Output":"still waiting\n"}
`
	rn, err := read("e2e", strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	out, ok := render([]*stream{rn}, options{slowest: 1})
	if ok {
		t.Errorf("report says a run cut short passed:\n%s", out)
	}
	for _, want := range []string{"FAIL  p  [did not finish: 301.0s of output]", "=== DID NOT FINISH: TestLong (300.0s) in p [e2e]\nstill waiting\n"} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q:\n%s", want, out)
		}
	}
	got := failedList(t, out)
	want := []string{"e2e p TestLong (did not finish)", "e2e p [did not finish]"}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("FAILED list: %q, want %q", got, want)
	}
}
