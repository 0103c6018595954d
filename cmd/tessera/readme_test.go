package main

import (
	"bufio"
	"os"
	"strings"
	"testing"
)

// readmeCommand is one tessera command from a code block of the README.
type readmeCommand struct {
	line    int
	text    string // as written, comment removed
	name    string // tessera, or kubectl-tessera for `kubectl tessera`
	args    []string
	comment string
}

// readmeCommands reads the tessera commands from the code blocks of the
// Markdown file at path: lines that run the CLI built by `make cli`
// (_output/bin/tessera), go run ./cmd/tessera, an installed tessera, or
// kubectl tessera (which kubectl runs as kubectl-tessera with the same
// arguments). Other lines (make, kubectl apply, YAML) are not the CLI's.
func readmeCommands(t *testing.T, path string) []readmeCommand {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var cmds []readmeCommand
	inBlock := false
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if strings.HasPrefix(line, "```") {
			inBlock = !inBlock
			continue
		}
		if !inBlock {
			continue
		}
		text, comment, _ := strings.Cut(line, " #")
		text = strings.TrimSpace(text)
		var c readmeCommand
		for _, form := range []struct{ prefix, name string }{
			{"_output/bin/tessera ", "tessera"}, {"go run ./cmd/tessera ", "tessera"}, {"tessera ", "tessera"},
			{"kubectl tessera ", "kubectl-tessera"},
		} {
			if rest, ok := strings.CutPrefix(text+" ", form.prefix); ok {
				c = readmeCommand{line: n, text: text, name: form.name, args: strings.Fields(rest), comment: comment}
				break
			}
		}
		if c.name == "" {
			continue
		}
		if strings.ContainsAny(c.text, "'\"\\$|&;<>()`*?") {
			t.Fatalf("%s:%d: %q needs a shell to run as written; keep the README's tessera commands plain words", path, n, c.text)
		}
		cmds = append(cmds, c)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return cmds
}

// TestREADMECommandsRunInOrder runs the tessera commands of the README's
// code blocks in order, as a newcomer on a machine without GPUs or a
// cluster would (an empty home and temp dir, no kubeconfig, outside any
// pod, one environment for all of them, so that what one leaves behind
// reaches the next): each must succeed with output and nothing on stderr,
// except that one whose comment says it needs the NVIDIA driver may fail
// saying how to simulate a node instead, and one that needs a cluster may
// fail saying where it looked for one.
func TestREADMECommandsRunInOrder(t *testing.T) {
	cmds := readmeCommands(t, "../../README.md")
	if len(cmds) < 5 {
		t.Fatalf("found %d tessera commands in the README's code blocks, want at least 5: %+v", len(cmds), cmds)
	}
	env := newcomer(t)
	bins := map[string]string{"tessera": binary(t, "tessera"), "kubectl-tessera": binary(t, "kubectl-tessera")}
	for _, c := range cmds {
		got := run(t, bins[c.name], env, c.args...)
		switch {
		case got.code == 0 && got.stdout != "" && got.stderr == "":
		case got.code != 0 && strings.Contains(c.comment, "needs the NVIDIA driver") && strings.Contains(got.stderr, "--fake-node"):
		case got.code != 0 && strings.Contains(c.comment, "needs a cluster") && strings.Contains(got.stderr, "no cluster to ask"):
		default:
			t.Errorf("README.md:%d: %s: exit %d\nstdout:\n%s\nstderr:\n%s", c.line, c.text, got.code, head(got.stdout), got.stderr)
		}
	}
}

// head is the first lines of out.
func head(out string) string {
	lines := strings.SplitAfter(out, "\n")
	if len(lines) > 20 {
		return strings.Join(lines[:20], "") + "...\n"
	}
	return out
}
