package nodeopen_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tessera-dev/tessera/driver/fakenode"
	"github.com/tessera-dev/tessera/driver/nodeopen"
)

// open opens the node the options name, as a plugin process does, and
// closes it when the test ends.
func open(t *testing.T, o nodeopen.Options) error {
	t.Helper()
	n, err := o.Open()
	if err != nil {
		return err
	}
	t.Cleanup(func() { _ = n.Close() })
	return nil
}

// TestEachFakeProfileKeepsItsOwnState: a plugin process's simulated node
// keeps its driver state under the system temp dir by node name and
// profile, so simulating another profile under the same node name (the
// README's dgx-h100, then pcie-l4x4) starts from its own state, and the
// first profile's state is still there for its next process.
func TestEachFakeProfileKeepsItsOwnState(t *testing.T) {
	t.Setenv("TMPDIR", t.TempDir())
	for _, profile := range []string{"dgx-h100", "pcie-l4x4", "dgx-h100"} {
		if err := open(t, nodeopen.Options{NodeName: "node-a", FakeNode: profile}); err != nil {
			t.Fatalf("open %s after the others: %v", profile, err)
		}
	}
	states, err := filepath.Glob(filepath.Join(os.TempDir(), "*", fakenode.StateFile))
	if err != nil {
		t.Fatal(err)
	}
	if len(states) != 2 {
		t.Errorf("state files %v, want one per profile", states)
	}
}

// TestAFakeRootKeepsOneProfile: a --fake-root holds one simulated node's
// driver state; another profile opened over it, even one with as many
// GPUs, is refused with the directory and the fix, never handed the first
// profile's MIG instances.
func TestAFakeRootKeepsOneProfile(t *testing.T) {
	root := t.TempDir()
	if err := open(t, nodeopen.Options{NodeName: "node-a", FakeNode: "dgx-h100", FakeRoot: root}); err != nil {
		t.Fatal(err)
	}
	err := open(t, nodeopen.Options{NodeName: "node-a", FakeNode: "dgx-h200", FakeRoot: root})
	if err == nil {
		t.Fatal("a dgx-h200 opened over a dgx-h100's state")
	}
	for _, want := range []string{root, "dgx-h100", "--fake-root"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not name %q", err, want)
		}
	}
}
