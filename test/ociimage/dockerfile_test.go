package ociimage

import (
	"encoding/json"
	"maps"
	"os"
	"slices"
	"strings"
	"testing"
)

// instruction is one Dockerfile instruction with its arguments, continuation
// lines joined.
type instruction struct {
	cmd  string // upper case
	args string
}

// parseDockerfile splits a Dockerfile into stages (each starting at FROM).
func parseDockerfile(t *testing.T, text string) [][]instruction {
	t.Helper()
	var stages [][]instruction
	var cur strings.Builder
	flush := func() {
		line := strings.TrimSpace(cur.String())
		cur.Reset()
		if line == "" {
			return
		}
		cmd, args, _ := strings.Cut(line, " ")
		in := instruction{cmd: strings.ToUpper(cmd), args: strings.TrimSpace(args)}
		if in.cmd == "FROM" {
			stages = append(stages, nil)
		}
		if len(stages) == 0 {
			if in.cmd != "ARG" {
				t.Fatalf("Dockerfile: %s before the first FROM", in.cmd)
			}
			return
		}
		stages[len(stages)-1] = append(stages[len(stages)-1], in)
	}
	for _, line := range strings.Split(text, "\n") {
		trimmed := strings.TrimSpace(line)
		if strings.HasPrefix(trimmed, "#") {
			continue
		}
		if strings.HasSuffix(trimmed, "\\") {
			cur.WriteString(strings.TrimSuffix(trimmed, "\\") + " ")
			continue
		}
		cur.WriteString(trimmed)
		flush()
	}
	flush()
	return stages
}

// shellWords splits a command line as sh would for plain words and double
// or single quotes (all the Dockerfile uses).
func shellWords(s string) []string {
	var words []string
	var w strings.Builder
	inWord := false
	var quote rune
	for _, r := range s {
		switch {
		case quote != 0:
			if r == quote {
				quote = 0
			} else {
				w.WriteRune(r)
			}
		case r == '"' || r == '\'':
			quote, inWord = r, true
		case r == ' ' || r == '\t':
			if inWord {
				words = append(words, w.String())
				w.Reset()
				inWord = false
			}
		default:
			w.WriteRune(r)
			inWord = true
		}
	}
	if inWord {
		words = append(words, w.String())
	}
	return words
}

// TestOCIBuildMatchesTheDockerfile keeps the two ways of building Tessera's
// image in step: the Go build path (this package) uses the Dockerfile's
// base release, binaries, build flags, paths, entrypoint, user and labels,
// and the Dockerfile's final stage holds no instruction this package does
// not reproduce.
func TestOCIBuildMatchesTheDockerfile(t *testing.T) {
	data, err := os.ReadFile("../../Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	stages := parseDockerfile(t, string(data))
	if len(stages) != 2 {
		t.Fatalf("Dockerfile has %d stages, want a build stage and the image: teach test/ociimage the new layout", len(stages))
	}
	build, final := stages[0], stages[1]

	// The build stage's go build: environment, flags, packages.
	var goBuild []string
	for _, in := range build {
		if in.cmd == "RUN" && strings.Contains(in.args, "go build") {
			goBuild = shellWords(in.args)
		}
	}
	if goBuild == nil {
		t.Fatal("Dockerfile: no RUN with go build in the build stage")
	}
	i := slices.Index(goBuild, "go")
	if i < 0 || i+1 >= len(goBuild) || goBuild[i+1] != "build" {
		t.Fatalf("Dockerfile: cannot find `go build` in %q", goBuild)
	}
	if env := goBuild[:i]; !slices.Equal(env, GoBuildEnv) {
		t.Errorf("Dockerfile builds with environment %q, the OCI build with %q", env, GoBuildEnv)
	}
	rest := goBuild[i+2:]
	o := slices.Index(rest, "-o")
	if o < 0 || o+2 > len(rest) {
		t.Fatalf("Dockerfile: go build has no -o: %q", rest)
	}
	if flags := rest[:o]; !slices.Equal(flags, GoBuildArgs) {
		t.Errorf("Dockerfile builds with flags %q, the OCI build with %q", flags, GoBuildArgs)
	}
	outDir := strings.TrimSuffix(rest[o+1], "/")
	var commands []string
	for _, p := range rest[o+2:] {
		name, ok := strings.CutPrefix(p, "./cmd/")
		if !ok {
			t.Errorf("Dockerfile builds %s, not a command under ./cmd/", p)
		}
		commands = append(commands, name)
	}
	if !slices.Equal(commands, Commands) {
		t.Errorf("Dockerfile builds %q, the OCI build %q", commands, Commands)
	}

	// The image stage: base, what it copies, runs and says.
	user := ""
	var entrypoint []string
	labels := map[string]string{}
	for _, in := range final {
		switch in.cmd {
		case "FROM":
			want := "gcr.io/distroless/base-debian" + DebianRelease
			if in.args != want {
				t.Errorf("Dockerfile's image is based on %s, the OCI build on Debian %s packages as in %s", in.args, DebianRelease, want)
			}
		case "COPY":
			w := shellWords(in.args)
			if len(w) != 3 || w[0] != "--from=build" || strings.TrimSuffix(w[1], "/") != outDir || strings.TrimSuffix(w[2], "/") != BinDir {
				t.Errorf("Dockerfile: COPY %s; the OCI build copies the binaries from the build's %s to %s", in.args, outDir, BinDir)
			}
		case "ENTRYPOINT":
			if err := json.Unmarshal([]byte(in.args), &entrypoint); err != nil {
				t.Errorf("Dockerfile: ENTRYPOINT %s is not in exec form: %v", in.args, err)
			}
		case "USER":
			user = in.args
		case "LABEL":
			w := shellWords(in.args)
			for _, kv := range w {
				k, v, ok := strings.Cut(kv, "=")
				if !ok {
					t.Errorf("Dockerfile: LABEL %q is not key=value", kv)
				}
				labels[k] = v
			}
		default:
			t.Errorf("Dockerfile's image stage has %s %s, which the OCI build (test/ociimage) does not reproduce: teach it there and here", in.cmd, in.args)
		}
	}
	if !slices.Equal(entrypoint, Entrypoint) {
		t.Errorf("Dockerfile's entrypoint is %q, the OCI build's %q", entrypoint, Entrypoint)
	}
	if user != User {
		t.Errorf("Dockerfile's user is %q, the OCI build's %q", user, User)
	}
	if !maps.Equal(labels, Labels) {
		t.Errorf("Dockerfile's labels are %v, the OCI build's %v", labels, Labels)
	}
}
