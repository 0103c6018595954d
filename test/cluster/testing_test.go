package cluster

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// TestCopyLogsSinceCopiesWhatEachComponentLoggedDuringATest checks what a
// failed test leaves behind (LogsOnFailure): each log's part written since
// the test began, a log that began meanwhile whole, none that stayed
// unchanged.
func TestCopyLogsSinceCopiesWhatEachComponentLoggedDuringATest(t *testing.T) {
	c := &Cluster{dir: t.TempDir()}
	if err := os.MkdirAll(c.logDir(), 0o750); err != nil {
		t.Fatal(err)
	}
	write := func(name, data string) {
		f, err := os.OpenFile(c.logPath(name), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.WriteString(data); err != nil {
			t.Fatal(err)
		}
		if err := f.Close(); err != nil {
			t.Fatal(err)
		}
	}
	write("kube-apiserver", "before\n")
	write("kube-scheduler", "before\n")
	offsets := map[string]int64{c.logPath("kube-apiserver"): 7, c.logPath("kube-scheduler"): 7}
	write("kube-apiserver", "during\n")
	write("kubelet-node-a", "started during\n")

	dir := filepath.Join(c.dir, "failed", "TestX__sub")
	copies, err := c.copyLogsSince(dir, offsets)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{filepath.Join(dir, "kube-apiserver.log"), filepath.Join(dir, "kubelet-node-a.log")}
	if !slices.Equal(copies, want) {
		t.Errorf("copies %v, want %v", copies, want)
	}
	for path, content := range map[string]string{want[0]: "during\n", want[1]: "started during\n", filepath.Join(dir, "kube-scheduler.log"): ""} {
		got, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if string(got) != content {
			t.Errorf("%s holds %q, want %q", path, got, content)
		}
	}
}
