package main

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestMain makes the test binary the tessera binary too: run through a link
// named tessera or kubectl-tessera (see binary), it runs main, so the tests
// run the command as a user does, by name, in a process of its own.
func TestMain(m *testing.M) {
	switch filepath.Base(os.Args[0]) {
	case "tessera", "kubectl-tessera":
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// binary links name (tessera or kubectl-tessera) to this test binary in a
// directory of its own and returns the link's path.
func binary(t *testing.T, name string) string {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), name)
	if err := os.Symlink(self, path); err != nil {
		t.Fatal(err)
	}
	return path
}

// newcomer is the environment of someone who has just cloned the
// repository: an empty home and temp dir, no kubeconfig, outside any pod.
func newcomer(t *testing.T) []string {
	t.Helper()
	env := []string{"PATH=" + os.Getenv("PATH"), "HOME=" + t.TempDir(), "TMPDIR=" + t.TempDir()}
	if dir := os.Getenv("GOCOVERDIR"); dir != "" {
		env = append(env, "GOCOVERDIR="+dir)
	} else if testing.CoverMode() != "" {
		env = append(env, "GOCOVERDIR="+t.TempDir()) // else every run warns
	}
	return env
}

// result is what a run printed and how it ended.
type result struct {
	stdout, stderr string
	code           int
}

// run runs the binary at path with args in env.
func run(t *testing.T, path string, env []string, args ...string) result {
	t.Helper()
	cmd := exec.Command(path, args...)
	cmd.Env = env
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) {
		t.Fatalf("run %s %s: %v", path, strings.Join(args, " "), err)
	}
	return result{stdout: stdout.String(), stderr: stderr.String(), code: cmd.ProcessState.ExitCode()}
}

// TestUsageNamesTheCommandAsItWasRun: installed as kubectl-tessera (a
// kubectl plugin), the tool's usage and help say `kubectl tessera ...`,
// which is what the user types; as tessera they say `tessera ...`.
func TestUsageNamesTheCommandAsItWasRun(t *testing.T) {
	for _, c := range []struct {
		name    string
		want    []string
		wantNot string
		subWant string
	}{
		{
			name:    "kubectl-tessera",
			want:    []string{"\n  kubectl tessera [command]\n", `Use "kubectl tessera [command] --help"`},
			wantNot: "\n  tessera [command]",
			subWant: "\n  kubectl tessera explain CLAIM [flags]\n",
		},
		{
			name:    "tessera",
			want:    []string{"\n  tessera [command]\n", `Use "tessera [command] --help"`},
			wantNot: "kubectl",
			subWant: "\n  tessera explain CLAIM [flags]\n",
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			bin, env := binary(t, c.name), newcomer(t)
			help := run(t, bin, env, "--help")
			if help.code != 0 {
				t.Fatalf("%s --help: exit %d, stderr:\n%s", c.name, help.code, help.stderr)
			}
			for _, want := range c.want {
				if !strings.Contains(help.stdout, want) {
					t.Errorf("%s --help lacks %q:\n%s", c.name, want, help.stdout)
				}
			}
			if strings.Contains(help.stdout, c.wantNot) {
				t.Errorf("%s --help says %q:\n%s", c.name, c.wantNot, help.stdout)
			}
			sub := run(t, bin, env, "explain", "--help")
			if !strings.Contains(sub.stdout, c.subWant) {
				t.Errorf("%s explain --help lacks %q:\n%s", c.name, c.subWant, sub.stdout)
			}
		})
	}
}

// TestExplainWithoutAClusterSaysWhereItLooked: with no kubeconfig anywhere
// and outside a pod, explain names each place it looked, as kubectl's
// loading rules look (--kubeconfig, KUBECONFIG, ~/.kube/config, the pod's
// service account), and how to point it at a cluster; never client-go's
// hint about KUBERNETES_MASTER.
func TestExplainWithoutAClusterSaysWhereItLooked(t *testing.T) {
	dir := t.TempDir()
	missing, empty := filepath.Join(dir, "no-such-kubeconfig"), filepath.Join(dir, "empty-kubeconfig")
	if err := os.WriteFile(empty, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		env  []string // beside a newcomer's
		args []string
		want func(home string) []string
	}{
		{
			name: "nothing set",
			want: func(home string) []string {
				return []string{"--kubeconfig is not set", "KUBECONFIG is not set", filepath.Join(home, ".kube", "config") + " does not exist",
					"not in a pod (KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are not set)", "--kubeconfig=PATH or KUBECONFIG=PATH"}
			},
		},
		{
			name: "KUBECONFIG names a missing file",
			env:  []string{"KUBECONFIG=" + missing},
			want: func(string) []string {
				return []string{"KUBECONFIG=" + missing + ": " + missing + " does not exist", "not in a pod", "--kubeconfig=PATH or KUBECONFIG=PATH"}
			},
		},
		{
			name: "--kubeconfig names a file without a current context",
			args: []string{"--kubeconfig", empty},
			want: func(string) []string {
				return []string{"--kubeconfig " + empty + " has no current context", "not in a pod", "kubectl config use-context NAME"}
			},
		},
		{
			name: "--kubeconfig names a missing file",
			args: []string{"--kubeconfig", missing},
			want: func(string) []string { return []string{"--kubeconfig " + missing + ": ", "no such file"} },
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			env := append(newcomer(t), c.env...)
			var home string
			for _, kv := range env {
				if h, ok := strings.CutPrefix(kv, "HOME="); ok {
					home = h
				}
			}
			got := run(t, binary(t, "tessera"), env, append([]string{"explain", "train-0", "-n", "ml"}, c.args...)...)
			if got.code != 1 {
				t.Fatalf("exit %d, want 1; stdout:\n%s\nstderr:\n%s", got.code, got.stdout, got.stderr)
			}
			for _, want := range c.want(home) {
				if !strings.Contains(got.stderr, want) {
					t.Errorf("error lacks %q:\n%s", want, got.stderr)
				}
			}
			if strings.Contains(got.stderr, "KUBERNETES_MASTER") {
				t.Errorf("error names KUBERNETES_MASTER:\n%s", got.stderr)
			}
		})
	}
}
