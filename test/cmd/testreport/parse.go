package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"time"
)

// event is one line of `go test -json` (cmd/test2json) output.
type event struct {
	Time        time.Time
	Action      string
	Package     string
	Test        string
	Elapsed     float64 // seconds
	Output      string
	FailedBuild string
	ImportPath  string // build-output and build-fail events
}

// stream is one `go test -json` stream: the packages it tested in the order
// they started, and whatever it held that was not an event (the go
// command's own messages when stderr went to the same file).
type stream struct {
	name     string // the file's base name without .json: unit, e2e, ...
	packages []*pkg
	byName   map[string]*pkg
	builds   map[string]*strings.Builder // import path as the build names it -> compiler output
	stray    strings.Builder
}

// pkg is one package's result within a run.
type pkg struct {
	run         string
	path        string
	action      string // pass, fail, skip; "" when the stream ended first
	elapsed     float64
	start, last time.Time
	output      strings.Builder // output that belongs to no test
	failedBuild string          // the build that failed, as the go command names it
	buildOutput string
	tests       []*test // in the order they started
	byName      map[string]*test
}

// test is one test or subtest.
type test struct {
	name    string // TestX/sub/subsub
	action  string // pass, fail, skip; "" when it never ended
	elapsed float64
	start   time.Time
	output  strings.Builder
}

func (t *test) depth() int { return strings.Count(t.name, "/") }

// finished says whether the test or package reported an end.
func finished(action string) bool { return action == "pass" || action == "fail" || action == "skip" }

// read parses one `go test -json` stream. Lines that are not JSON events are
// kept as stray output, never dropped: they are usually the go command
// saying why it could not start.
func read(name string, r io.Reader) (*stream, error) {
	rn := &stream{name: name, byName: map[string]*pkg{}, builds: map[string]*strings.Builder{}}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 1<<20), 64<<20)
	for sc.Scan() {
		line := sc.Bytes()
		var e event
		if len(line) == 0 || line[0] != '{' || json.Unmarshal(line, &e) != nil || e.Action == "" {
			rn.stray.Write(line)
			rn.stray.WriteByte('\n')
			continue
		}
		rn.add(e)
	}
	if err := sc.Err(); err != nil {
		return rn, fmt.Errorf("read %s: %w", name, err)
	}
	for _, p := range rn.packages {
		if p.failedBuild != "" {
			if b := rn.builds[p.failedBuild]; b != nil {
				p.buildOutput = b.String()
			}
		}
	}
	return rn, nil
}

func (rn *stream) add(e event) {
	switch e.Action {
	case "build-output", "build-fail":
		b := rn.builds[e.ImportPath]
		if b == nil {
			b = &strings.Builder{}
			rn.builds[e.ImportPath] = b
		}
		b.WriteString(e.Output)
		return
	}
	if e.Package == "" {
		rn.stray.WriteString(e.Output)
		return
	}
	p := rn.byName[e.Package]
	if p == nil {
		p = &pkg{run: rn.name, path: e.Package, start: e.Time, byName: map[string]*test{}}
		rn.byName[e.Package] = p
		rn.packages = append(rn.packages, p)
	}
	if !e.Time.IsZero() {
		p.last = e.Time
	}
	if e.Test == "" {
		switch e.Action {
		case "output":
			p.output.WriteString(e.Output)
		case "pass", "fail", "skip":
			p.action, p.elapsed, p.failedBuild = e.Action, e.Elapsed, e.FailedBuild
		}
		return
	}
	t := p.byName[e.Test]
	if t == nil {
		t = &test{name: e.Test, start: e.Time}
		p.byName[e.Test] = t
		p.tests = append(p.tests, t)
	}
	switch e.Action {
	case "output":
		t.output.WriteString(e.Output)
	case "pass", "fail", "skip":
		t.action, t.elapsed = e.Action, e.Elapsed
	}
}

// duration is the test's elapsed time, or for a test that never ended (its
// package timed out or crashed), the time from its start to the package's
// last event.
func (t *test) duration(p *pkg) float64 {
	if finished(t.action) || t.start.IsZero() {
		return t.elapsed
	}
	return p.last.Sub(t.start).Seconds()
}

// failed says whether the package failed or never said how it ended.
func (p *pkg) failed() bool { return p.action == "fail" || p.action == "" }

// noTests says whether the package had no test to run ([no test files] or
// nothing matched).
func (p *pkg) noTests() bool { return p.action == "skip" || (p.action == "pass" && len(p.tests) == 0) }

// duration is the package's elapsed time, or for a package whose stream
// ended first, the time between its first and last events.
func (p *pkg) duration() float64 {
	if finished(p.action) {
		return p.elapsed
	}
	return p.last.Sub(p.start).Seconds()
}

// badTests are the tests that failed or never ended, in the order they
// started.
func (p *pkg) badTests() []*test {
	var bad []*test
	for _, t := range p.tests {
		if t.action == "fail" || t.action == "" {
			bad = append(bad, t)
		}
	}
	return bad
}
