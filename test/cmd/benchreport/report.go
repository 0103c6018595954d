package main

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
)

// entry is one key of bench.json. Value is null when the benchmark did not
// report the figure; Error then says why.
type entry struct {
	Value     *float64 `json:"value"`
	Unit      string   `json:"unit"`
	Goal      string   `json:"goal,omitempty"`
	Met       *bool    `json:"met,omitempty"`
	Benchmark string   `json:"benchmark"`
	Error     string   `json:"error,omitempty"`
}

// build turns results into the report's entries, one per figure.
func build(r *results) map[string]entry {
	out := make(map[string]entry, len(figures))
	for _, f := range figures {
		e := entry{Unit: f.Unit, Benchmark: f.Benchmark}
		if f.Goal != nil {
			e.Goal = f.Goal.String()
		}
		if v, ok := r.metrics[f.Benchmark][f.Metric]; ok {
			e.Value = &v
			if f.Goal != nil {
				met := f.Goal.met(v)
				e.Met = &met
			}
		} else {
			e.Error = missing(r, f)
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

// table prints the entries as a table, in the order of figures.
func table(w io.Writer, entries map[string]entry) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "FIGURE\tVALUE\tUNIT\tGOAL\tSTATUS")
	for _, f := range figures {
		e := entries[f.Key]
		value, status := "-", "no goal"
		if e.Value != nil {
			value = fmt.Sprintf("%.4g", *e.Value)
		}
		switch {
		case e.Value == nil:
			status = "MISSING (see error in the JSON report)"
		case e.Met != nil && *e.Met:
			status = "met"
		case e.Met != nil:
			status = "NOT MET"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", f.Key, value, e.Unit, e.Goal, status)
	}
	return tw.Flush()
}
