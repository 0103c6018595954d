package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"regexp"
	"strconv"
	"strings"
)

// results are what one or more `go test -json -bench` runs reported: each
// benchmark's metrics by unit, the benchmarks and packages that failed, and
// each failed one's last output lines.
type results struct {
	metrics map[string]map[string]float64 // benchmark -> unit -> value
	failed  map[string]string             // benchmark or package -> why
}

// event is the part of a test2json event that matters here.
type event struct {
	Action  string
	Package string
	Test    string
	Output  string
}

var (
	// A result line: name, iterations, then value/unit pairs. The name may
	// have been printed on a line of its own before the benchmark's own
	// output (see pending in parse).
	resultLine = regexp.MustCompile(`^(Benchmark\S+)\s+(\d+\s+[0-9.]+ ns/op.*)$`)
	nameOnly   = regexp.MustCompile(`^(Benchmark\S+?)\s*$`)
	figuresFor = regexp.MustCompile(`^\s*(\d+\s+[0-9.]+ ns/op.*)$`)
	procSuffix = regexp.MustCompile(`-\d+$`)
)

func newResults() *results {
	return &results{metrics: map[string]map[string]float64{}, failed: map[string]string{}}
}

// parse reads one test2json stream (go test -json).
func (r *results) parse(in io.Reader) error {
	s := bufio.NewScanner(in)
	s.Buffer(make([]byte, 0, 64*1024), 16*1024*1024)
	tails := map[string][]string{} // test or package -> last output lines
	var pending, partial string
	for s.Scan() {
		var ev event
		if err := json.Unmarshal(s.Bytes(), &ev); err != nil {
			return fmt.Errorf("not go test -json output: %w", err)
		}
		who := ev.Package
		if ev.Test != "" {
			who = ev.Test
		}
		switch ev.Action {
		case "output":
			// test2json may split a line over events; join them.
			partial += ev.Output
			for {
				line, rest, ok := strings.Cut(partial, "\n")
				if !ok {
					break
				}
				partial = rest
				for _, k := range []string{who, ev.Package} {
					tails[k] = append(tails[k], line)
					if len(tails[k]) > 20 {
						tails[k] = tails[k][1:]
					}
				}
				if name, ok := strings.CutPrefix(strings.TrimSpace(line), "--- FAIL: "); ok {
					name, _, _ = strings.Cut(name, " ")
					r.failed[procSuffix.ReplaceAllString(name, "")] = strings.Join(tails[ev.Package], "\n")
				}
				if m := resultLine.FindStringSubmatch(line); m != nil {
					r.add(m[1], m[2])
					pending = ""
				} else if m := nameOnly.FindStringSubmatch(line); m != nil {
					pending = m[1]
				} else if m := figuresFor.FindStringSubmatch(line); m != nil && pending != "" {
					r.add(pending, m[1])
					pending = ""
				} else if name, rest, ok := strings.Cut(line, "\t"); ok && pending == "" && nameOnly.MatchString(name) && !strings.Contains(rest, "ns/op") {
					// "BenchmarkX-2   \t" followed by someone else's log line.
					pending = strings.TrimSpace(name)
				}
			}
		case "fail":
			if _, known := r.failed[procSuffix.ReplaceAllString(who, "")]; !known {
				r.failed[procSuffix.ReplaceAllString(who, "")] = strings.Join(tails[who], "\n")
			}
		}
	}
	return s.Err()
}

// add records a result line's value/unit pairs (after the iteration count).
func (r *results) add(name, figures string) {
	name = procSuffix.ReplaceAllString(name, "")
	fields := strings.Fields(figures)
	m := r.metrics[name]
	if m == nil {
		m = map[string]float64{}
		r.metrics[name] = m
	}
	for i := 1; i+1 < len(fields); i += 2 {
		if v, err := strconv.ParseFloat(fields[i], 64); err == nil {
			m[fields[i+1]] = v
		}
	}
}
