// Command benchreport turns the output of `go test -json -bench` runs into
// Tessera's benchmark report: a table on stdout and a JSON file with one key
// per figure (value, unit, goal, whether it is met), so that results can be
// compared across commits. A figure whose benchmark failed or did not run is
// written with a null value and the reason, never guessed; the command then
// exits non-zero after writing the report. Missed goals do not fail it: the
// figures are measurements, not assertions.
//
//	go test -json -run '^$' -bench . ./driver/slices/ > slices.json
//	go run ./test/cmd/benchreport -o _output/bench.json slices.json ...
package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "benchreport:", err)
		os.Exit(1)
	}
}

func run() error {
	out := flag.String("o", "_output/bench.json", "Where to write the JSON report.")
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), "usage: benchreport [-o report.json] GO-TEST-JSON-FILE...\n")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() == 0 {
		flag.Usage()
		return fmt.Errorf("no go test -json output given")
	}
	r := newResults()
	for _, path := range flag.Args() {
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
	entries := build(r)
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
	if err := table(os.Stdout, entries); err != nil {
		return err
	}
	fmt.Printf("\nreport written to %s\n", *out)
	var absent int
	for _, e := range entries {
		if e.Value == nil {
			absent++
		}
	}
	if absent > 0 {
		return fmt.Errorf("%d figures missing: their benchmarks failed or did not run (see %s)", absent, *out)
	}
	return nil
}
