// Command testreport reads the output of `go test -json` runs and says what
// happened in words: a line per package, every failed test's whole output
// under its full name (a failed subtest is named, not only its parent), the
// tests a timeout or crash left unfinished, the output a failed package
// wrote outside any test, and the counts. With -slowest N it adds tables of
// the N slowest packages, tests and subtests, so anyone can see where a
// run's time goes. It exits 1 when anything failed or did not finish.
//
// Each file is one run, named by its base name without .json (make test
// writes _output/test/e2e.json, unit.json, faultinject.json, oracle.json):
//
//	go test -json ./... > _output/test/unit.json
//	go run ./test/cmd/testreport _output/test/unit.json
//	go run ./test/cmd/testreport -brief -slowest 10 _output/test/*.json
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

func main() {
	ok, err := run()
	if err != nil {
		fmt.Fprintln(os.Stderr, "testreport:", err)
		os.Exit(2)
	}
	if !ok {
		os.Exit(1)
	}
}

func run() (bool, error) {
	var o options
	flag.BoolVar(&o.verbose, "v", false, "Also write every test's output, as go test -v does.")
	flag.BoolVar(&o.brief, "brief", false, "Leave out the package lines and the failures' output: counts, tables and the names of what failed.")
	flag.IntVar(&o.slowest, "slowest", 0, "Rows in the tables of the slowest packages, tests and subtests (0: no tables).")
	flag.StringVar(&o.trim, "trim", "github.com/tessera-dev/tessera/", "Prefix cut from package paths.")
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), "usage: testreport [-v] [-brief] [-slowest N] GO-TEST-JSON-FILE...\n")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() == 0 {
		flag.Usage()
		return false, fmt.Errorf("no go test -json output given")
	}
	var runs []*stream
	for _, path := range flag.Args() {
		f, err := os.Open(path)
		if err != nil {
			return false, err
		}
		rn, err := read(strings.TrimSuffix(filepath.Base(path), ".json"), f)
		_ = f.Close()
		if err != nil {
			return false, err
		}
		runs = append(runs, rn)
	}
	return report(os.Stdout, runs, o), nil
}
