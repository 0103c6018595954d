package main

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
)

// entry is one key of bench.json. Value is null when the benchmark did not
// report the figure; Error then says why. N and Spread are there when the
// benchmark reports them (<metric>-n, <metric>-lo and <metric>-hi): how many
// samples the figure summarises, and the lowest and highest of its
// independent estimates (each sample, or each batch where the figure is a
// median of many).
type entry struct {
	Value     *float64    `json:"value"`
	Unit      string      `json:"unit"`
	N         *int        `json:"n,omitempty"`
	Spread    *[2]float64 `json:"spread,omitempty"`
	Goal      string      `json:"goal,omitempty"`
	Met       *bool       `json:"met,omitempty"`
	Status    string      `json:"status"`
	Benchmark string      `json:"benchmark"`
	Error     string      `json:"error,omitempty"`
}

// The statuses of an entry; the last three fail the report.
const (
	statusNoGoal     = "no goal"
	statusMet        = "met"
	statusNotMet     = "NOT MET"
	statusFewSamples = "TOO FEW SAMPLES"
	statusMissing    = "MISSING"
)

// failed says whether the entry fails the report: its goal missed or not
// judged on enough samples, or its value absent.
func (e entry) failed() bool {
	return e.Status == statusNotMet || e.Status == statusFewSamples || e.Status == statusMissing
}

// build turns results into the report's entries, one per figure of figs.
func build(r *results, figs []figure) map[string]entry {
	out := make(map[string]entry, len(figs))
	for _, f := range figs {
		e := entry{Unit: f.Unit, Benchmark: f.Benchmark, Status: statusNoGoal}
		if f.Goal != nil {
			e.Goal = f.Goal.String()
		}
		m := r.metrics[f.Benchmark]
		if n, ok := m[f.Metric+"-n"]; ok {
			e.N = new(int(n))
		}
		lo, okLo := m[f.Metric+"-lo"]
		hi, okHi := m[f.Metric+"-hi"]
		if okLo && okHi {
			e.Spread = &[2]float64{lo, hi}
		}
		v, ok := m[f.Metric]
		switch {
		case !ok:
			e.Error = missing(r, f)
			e.Status = statusMissing
		case f.Goal == nil:
			e.Value = &v
		default:
			e.Value = &v
			met := f.Goal.met(v)
			e.Met = &met
			e.Status = statusMet
			if !met {
				e.Status = statusNotMet
			}
			if f.Goal.MinSamples > 0 && (e.N == nil || *e.N < f.Goal.MinSamples) {
				// A figure of too few samples says nothing either
				// way: the goal is not judged, and the report fails.
				e.Met = nil
				e.Status = statusFewSamples
				have := "no sample count"
				if e.N != nil {
					have = fmt.Sprintf("%d samples", *e.N)
				}
				e.Error = fmt.Sprintf("%s reported %s; the goal is judged on at least %d", f.Benchmark, have, f.Goal.MinSamples)
			}
		}
		out[f.Key] = e
	}
	return out
}

// missing says why a figure is absent: its benchmark (or a parent, or its
// package) failed, or it never ran.
func missing(r *results, f figure) string {
	for name, tail := range r.failed {
		if name == f.Benchmark || strings.HasPrefix(f.Benchmark, name+"/") {
			return fmt.Sprintf("%s failed:\n%s", name, tail)
		}
	}
	if _, ran := r.metrics[f.Benchmark]; ran {
		return fmt.Sprintf("%s ran but reported no %q", f.Benchmark, f.Metric)
	}
	for name, tail := range r.failed {
		if !strings.HasPrefix(name, "Benchmark") && !strings.HasPrefix(name, "Test") {
			return fmt.Sprintf("%s did not run (package %s failed):\n%s", f.Benchmark, name, tail)
		}
	}
	return fmt.Sprintf("%s did not run", f.Benchmark)
}

// table prints the entries as a table, in the order of figs.
func table(w io.Writer, figs []figure, entries map[string]entry) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "FIGURE\tVALUE\tN\tSPREAD\tUNIT\tGOAL\tSTATUS")
	for _, f := range figs {
		e := entries[f.Key]
		value, n, spread, status := "-", "", "", e.Status
		if e.Value != nil {
			value = fmt.Sprintf("%.4g", *e.Value)
		}
		if e.N != nil {
			n = fmt.Sprint(*e.N)
		}
		if e.Spread != nil {
			spread = fmt.Sprintf("%.4g–%.4g", e.Spread[0], e.Spread[1])
		}
		switch e.Status {
		case statusMissing:
			status += " (see error in the JSON report)"
		case statusFewSamples:
			status += " (" + e.Error + ")"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", f.Key, value, n, spread, e.Unit, e.Goal, status)
	}
	return tw.Flush()
}

// failures lists the entries that fail the report, in the order of figs:
// each with its value and goal, or why it is absent.
func failures(figs []figure, entries map[string]entry) []string {
	var out []string
	for _, f := range figs {
		e := entries[f.Key]
		if !e.failed() {
			continue
		}
		switch e.Status {
		case statusMissing:
			first, _, _ := strings.Cut(e.Error, "\n")
			out = append(out, fmt.Sprintf("%s missing (%s)", f.Key, first))
		case statusFewSamples:
			out = append(out, fmt.Sprintf("%s = %.4g not judged: %s", f.Key, *e.Value, e.Error))
		default:
			out = append(out, fmt.Sprintf("%s = %.4g %s, goal %s", f.Key, *e.Value, e.Unit, e.Goal))
		}
	}
	return out
}
