package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tessera-dev/tessera/component"
	"github.com/tessera-dev/tessera/driver/plugin"
)

// TestBinaryExitsCleanlyOnSIGTERM runs the real binary on a fake node and
// checks that SIGTERM ends it with status 0 and no sockets left behind.
func TestBinaryExitsCleanlyOnSIGTERM(t *testing.T) {
	dir, err := os.MkdirTemp("", "tkp")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = os.RemoveAll(dir) }()
	bin := filepath.Join(dir, "tessera-kubelet-plugin")
	build := exec.Command("go", "build", "-o", bin, ".")
	build.Env = append(os.Environ(), "CGO_CFLAGS=-Wno-deprecated-declarations")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	kubeconfig := unreachableKubeconfig(t, dir)
	bootID := filepath.Join(dir, "boot_id")
	_ = os.WriteFile(bootID, []byte("b\n"), 0o644)
	reg := filepath.Join(dir, "reg")
	data := filepath.Join(dir, "data")
	_ = os.MkdirAll(reg, 0o755)
	// Metrics on a free loopback port: the default port may be taken here.
	cmd := exec.Command(bin, "--kubeconfig", kubeconfig, "--fake-node", "pcie-l4x4", "--metrics-address", "127.0.0.1:0",
		"--cdi-root", filepath.Join(dir, "cdi"), "--plugin-data-dir", data, "--registrar-dir", reg, "--boot-id-file", bootID)
	cmd.Env = append(os.Environ(), "NODE_NAME=node-sig", "FAKE_ROOT="+filepath.Join(dir, "host"))
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	sockets := func() []string {
		var s []string
		for _, d := range []string{reg, data} {
			entries, _ := os.ReadDir(d)
			for _, e := range entries {
				if e.Type()&os.ModeSocket != 0 {
					s = append(s, e.Name())
				}
			}
		}
		return s
	}
	deadline := time.Now().Add(20 * time.Second)
	for len(sockets()) < 2 {
		if time.Now().After(deadline) {
			_ = cmd.Process.Kill()
			t.Fatalf("sockets never appeared: %v\n%s", sockets(), out.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("exit after SIGTERM: %v\n%s", err, out.String())
		}
	case <-time.After(15 * time.Second):
		_ = cmd.Process.Kill()
		t.Fatalf("still running 15s after SIGTERM\n%s", out.String())
	}
	if s := sockets(); len(s) != 0 {
		t.Errorf("sockets left after SIGTERM: %v", s)
	}
	if !strings.Contains(out.String(), "Shutting down") {
		t.Errorf("no shutdown log line:\n%s", out.String())
	}
}

func TestBinaryRefusesAMissingNVMLWithoutFakeNode(t *testing.T) {
	// Validate and open the node as main does, with no --fake-node on a
	// machine without the NVIDIA driver: a clear error, never a silent fake.
	if _, err := os.Stat("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"); err == nil {
		t.Fatal("this check needs a machine without the NVIDIA driver")
	}
	var o plugin.Options
	err := component.Run("tessera-kubelet-plugin", []string{"--kubeconfig", unreachableKubeconfig(t, t.TempDir()), "--node-name", "n"}, &o,
		func(ctx context.Context) error { return run(ctx, o) })
	if err == nil || !strings.Contains(err.Error(), "libnvidia-ml.so.1 not found") || !strings.Contains(err.Error(), "--fake-node") {
		t.Fatalf("got %v, want the missing-NVML error naming the fix", err)
	}
}

// unreachableKubeconfig points at an API server that refuses connections:
// registration with the kubelet and shutdown must not depend on it.
func unreachableKubeconfig(t *testing.T, dir string) string {
	t.Helper()
	path := filepath.Join(dir, "kubeconfig")
	if err := os.WriteFile(path, []byte(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: c, context: {cluster: c, user: u}}]
current-context: c
`), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}
