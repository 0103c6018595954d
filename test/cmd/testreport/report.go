package main

import (
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"
)

// options choose what the report shows.
type options struct {
	verbose bool   // every test's output, as go test -v prints it
	brief   bool   // no package lines and no failure output: names and tables only
	slowest int    // rows in each table of the slowest packages, tests and subtests; 0: no tables
	trim    string // prefix cut from package paths
}

// report writes what the runs hold and says whether everything passed.
// Unless brief, it writes a line per package that ran tests, then every
// failed test's whole output (a failed subtest under its full name), the
// output of each failed package that belongs to no test (TestMain, a panic
// between tests, a timeout), and the compiler's output of a failed build.
// It always ends with the totals and, when anything failed, the list of
// what failed, deepest subtests by name.
func report(w io.Writer, runs []*stream, o options) bool {
	ok := true
	for _, rn := range runs {
		if len(runs) > 1 && (o.verbose || !o.brief) {
			fmt.Fprintf(w, "\n== %s\n", rn.name)
		}
		if o.verbose {
			writeVerbose(w, rn)
		}
		if !o.brief {
			writePackages(w, rn, o)
			writeFailures(w, rn, o)
		}
		for _, p := range rn.packages {
			if p.failed() {
				ok = false
			}
		}
	}
	if o.slowest > 0 {
		writeSlowest(w, runs, o)
	}
	writeTotals(w, runs)
	if !ok {
		writeFailedNames(w, runs, o)
	}
	return ok
}

func (o options) name(p *pkg) string { return strings.TrimPrefix(p.path, o.trim) }

func writeVerbose(w io.Writer, rn *stream) {
	for _, p := range rn.packages {
		for _, t := range p.tests {
			_, _ = io.WriteString(w, t.output.String())
		}
	}
}

func writePackages(w io.Writer, rn *stream, o options) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	for _, p := range rn.packages {
		switch {
		case p.failedBuild != "":
			fmt.Fprintf(tw, "FAIL\t%s\t[build failed]\n", o.name(p))
		case p.action == "":
			fmt.Fprintf(tw, "FAIL\t%s\t[did not finish: %.1fs of output]\n", o.name(p), p.duration())
		case p.noTests():
			continue
		case p.action == "fail":
			fmt.Fprintf(tw, "FAIL\t%s\t%.1fs\n", o.name(p), p.elapsed)
		default:
			fmt.Fprintf(tw, "ok\t%s\t%.1fs\n", o.name(p), p.elapsed)
		}
	}
	_ = tw.Flush()
	if s := rn.stray.String(); strings.TrimSpace(s) != "" {
		fmt.Fprintf(w, "\n=== %s: output of the go command, not of a test:\n%s", rn.name, ensureNewline(s))
	}
}

func writeFailures(w io.Writer, rn *stream, o options) {
	for _, p := range rn.packages {
		if !p.failed() {
			continue
		}
		for _, t := range p.badTests() {
			how := "FAIL"
			if t.action == "" {
				how = "DID NOT FINISH"
			}
			fmt.Fprintf(w, "\n=== %s: %s (%.1fs) in %s [%s]\n%s", how, t.name, t.duration(p), o.name(p), rn.name, ensureNewline(t.output.String()))
		}
		if p.buildOutput != "" {
			fmt.Fprintf(w, "\n=== BUILD FAILED: %s [%s]\n%s", o.name(p), rn.name, ensureNewline(p.buildOutput))
		}
		if out := p.output.String(); strings.TrimSpace(out) != "" {
			fmt.Fprintf(w, "\n=== FAILED PACKAGE %s [%s]: its output outside any test\n%s", o.name(p), rn.name, ensureNewline(out))
		}
	}
}

func count(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return fmt.Sprintf("%d %ss", n, what)
}

func ensureNewline(s string) string {
	if s == "" || strings.HasSuffix(s, "\n") {
		return s
	}
	return s + "\n"
}

// writeTotals counts packages and tests per run.
func writeTotals(w io.Writer, runs []*stream) {
	fmt.Fprintln(w)
	for _, rn := range runs {
		var pkgs, empty, pkgFailed, passed, failed, skipped, unfinished int
		for _, p := range rn.packages {
			pkgs++
			if p.noTests() {
				empty++
			}
			if p.failed() {
				pkgFailed++
			}
			for _, t := range p.tests {
				switch t.action {
				case "pass":
					passed++
				case "fail":
					failed++
				case "skip":
					skipped++
				default:
					unfinished++
				}
			}
		}
		status := "ok"
		if pkgFailed > 0 {
			status = fmt.Sprintf("FAILED (%s)", count(pkgFailed, "package"))
		}
		fmt.Fprintf(w, "%s: %s; %s (%d without tests to run); %d tests and subtests: %d passed, %d failed, %d skipped",
			rn.name, status, count(pkgs, "package"), empty, passed+failed+skipped+unfinished, passed, failed, skipped)
		if unfinished > 0 {
			fmt.Fprintf(w, ", %d did not finish", unfinished)
		}
		fmt.Fprintln(w)
	}
}

// writeFailedNames lists what failed: each failed or unfinished test none of
// whose subtests failed (so a subtest is named, not only its parent), and
// each failed package no failed test accounts for.
func writeFailedNames(w io.Writer, runs []*stream, o options) {
	fmt.Fprintln(w, "\nFAILED:")
	for _, rn := range runs {
		for _, p := range rn.packages {
			if !p.failed() {
				continue
			}
			bad := p.badTests()
			for _, t := range bad {
				if hasBadChild(t, bad) {
					continue
				}
				how := ""
				if t.action == "" {
					how = " (did not finish)"
				}
				fmt.Fprintf(w, "  %s  %s  %s%s\n", rn.name, o.name(p), t.name, how)
			}
			switch {
			case p.failedBuild != "":
				fmt.Fprintf(w, "  %s  %s  [build failed]\n", rn.name, o.name(p))
			case p.action == "":
				fmt.Fprintf(w, "  %s  %s  [did not finish]\n", rn.name, o.name(p))
			case len(bad) == 0:
				fmt.Fprintf(w, "  %s  %s  [failed outside any test: see its output]\n", rn.name, o.name(p))
			}
		}
	}
}

func hasBadChild(t *test, bad []*test) bool {
	for _, b := range bad {
		if strings.HasPrefix(b.name, t.name+"/") {
			return true
		}
	}
	return false
}

// writeSlowest writes three tables: packages, top-level tests and subtests,
// each the o.slowest longest, longest first.
func writeSlowest(w io.Writer, runs []*stream, o options) {
	type row struct {
		secs      float64
		run, name string
	}
	var pkgs, tests, subtests []row
	for _, rn := range runs {
		for _, p := range rn.packages {
			if p.noTests() {
				continue
			}
			pkgs = append(pkgs, row{p.duration(), rn.name, o.name(p)})
			for _, t := range p.tests {
				r := row{t.duration(p), rn.name, o.name(p) + " " + t.name}
				if t.depth() == 0 {
					tests = append(tests, r)
				} else {
					subtests = append(subtests, r)
				}
			}
		}
	}
	for _, table := range []struct {
		title string
		rows  []row
	}{{"packages", pkgs}, {"tests", tests}, {"subtests", subtests}} {
		rows := table.rows
		sort.SliceStable(rows, func(i, j int) bool { return rows[i].secs > rows[j].secs })
		if len(rows) > o.slowest {
			rows = rows[:o.slowest]
		}
		if len(rows) == 0 {
			continue
		}
		fmt.Fprintf(w, "\nslowest %s:\n", table.title)
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "  seconds\trun\tname")
		for _, r := range rows {
			fmt.Fprintf(tw, "%9.1f\t%s\t%s\n", r.secs, r.run, r.name)
		}
		_ = tw.Flush()
	}
}
