// Command benchreport turns the output of `go test -json -bench` runs into
// Tessera's benchmark report: a table on stdout and a JSON file with one key
// per figure (value, unit, sample count and spread where the benchmark
// reports them, goal, whether it is met), so that results can be compared
// across commits. A figure whose benchmark failed or did not run is written
// with a null value and the reason, never guessed. After printing every
// figure the command exits non-zero if any goal is missed, any figure is
// missing, or a goal that must be judged on a number of samples got fewer:
// a regression fails `make bench`.
//
// -short reports and judges only the short subset CI runs (make
// bench-short): the figures whose goal is marked short in figures.go.
//
//	go test -json -run '^$' -bench . ./driver/slices/ > slices.json
//	go run ./test/cmd/benchreport -o _output/bench.json slices.json ...
package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
)

func main() {
	if err := run(os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "benchreport:", err)
		os.Exit(1)
	}
}

func run(args []string, stdout io.Writer) error {
	flags := flag.NewFlagSet("benchreport", flag.ContinueOnError)
	out := flags.String("o", "_output/bench.json", "Where to write the JSON report.")
	short := flags.Bool("short", false, "Report and judge only the short subset CI runs.")
	flags.Usage = func() {
		fmt.Fprintf(flags.Output(), "usage: benchreport [-o report.json] [-short] GO-TEST-JSON-FILE...\n")
		flags.PrintDefaults()
	}
	if err := flags.Parse(args); err != nil {
		return err
	}
	if flags.NArg() == 0 {
		flags.Usage()
		return fmt.Errorf("no go test -json output given")
	}
	r := newResults()
	for _, path := range flags.Args() {
		f, err := os.Open(path)
		if err != nil {
			return err
		}
		err = r.parse(f)
		_ = f.Close()
		if err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
	}
	figs := figures
	if *short {
		figs = shortFigures()
	}
	entries := build(r, figs)
	var raw bytes.Buffer
	enc := json.NewEncoder(&raw)
	enc.SetEscapeHTML(false) // goals read "< 500", not "\u003c 500"
	enc.SetIndent("", "  ")
	if err := enc.Encode(entries); err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(*out), 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(*out, raw.Bytes(), 0o644); err != nil {
		return err
	}
	if err := table(stdout, figs, entries); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "\nreport written to %s\n", *out)
	if failed := failures(figs, entries); len(failed) > 0 {
		fmt.Fprintf(stdout, "\n%d of %d figures fail:\n  %s\n", len(failed), len(figs), strings.Join(failed, "\n  "))
		keys := make([]string, len(failed))
		for i, f := range failed {
			keys[i], _, _ = strings.Cut(f, " ")
		}
		return fmt.Errorf("%d of %d figures missed their goal, were judged on too few samples or are missing: %s (see %s)",
			len(failed), len(figs), strings.Join(keys, ", "), *out)
	}
	return nil
}

// shortFigures are the figures of the short subset.
func shortFigures() []figure {
	var out []figure
	for _, f := range figures {
		if f.Goal != nil && f.Goal.Short {
			out = append(out, f)
		}
	}
	return out
}
