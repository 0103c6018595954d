//go:build amd64

package fakenode

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestFakeMPSDaemonRunsUntilStopped (amd64, where the fake daemon is a
// program; elsewhere it is a failing script like the other tools) runs the fake driver's
// nvidia-cuda-mps-control -f as the plugin's daemon pod would: it keeps
// running, and a SIGTERM (what a container's stop sends first) ends it
// with status 0.
func TestFakeMPSDaemonRunsUntilStopped(t *testing.T) {
	root := t.TempDir()
	if err := InstallDriver(root, "usr/lib/x86_64-linux-gnu", "550.54.15"); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(filepath.Join(root, "usr", "bin", "nvidia-cuda-mps-control"), "-f")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	// Still running once it waits for the signals: in rt_sigtimedwait
	// (128), whose number /proc shows for a process blocked in a call.
	status := filepath.Join("/proc", strconv.Itoa(cmd.Process.Pid), "syscall")
	deadline := time.Now().Add(10 * time.Second)
	for {
		data, err := os.ReadFile(status)
		if err != nil {
			t.Fatal(err)
		}
		if strings.HasPrefix(string(data), "128 ") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the fake daemon never waited for a signal: /proc shows it in %q", data)
		}
		select {
		case err := <-exited:
			t.Fatalf("the fake daemon exited on its own: %v", err)
		case <-time.After(10 * time.Millisecond):
		}
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-exited:
		if err != nil {
			t.Fatalf("the fake daemon ended with %v after SIGTERM, want status 0", err)
		}
	case <-time.After(10 * time.Second):
		_ = cmd.Process.Kill()
		t.Fatal("the fake daemon did not stop on SIGTERM")
	}
}
