package hostnodes_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/tessera-dev/tessera/cdi"
	"github.com/tessera-dev/tessera/driver/gpulib"
	"github.com/tessera-dev/tessera/driver/hostnodes"
)

var (
	capNode     = cdi.DeviceNode{Path: "/dev/nvidia-caps/nvidia-cap21", Major: 236, Minor: 21}
	channelNode = cdi.DeviceNode{Path: "/dev/nvidia-caps-imex-channels/channel0", Major: 237, Minor: 0}
	gpuNode     = cdi.DeviceNode{Path: "/dev/nvidia0", Major: 195, Minor: 0}
)

func newNodes(t *testing.T, maker gpulib.NodeMaker) *hostnodes.Nodes {
	t.Helper()
	return &hostnodes.Nodes{Dir: filepath.Join(t.TempDir(), "records"), Maker: maker, DevRoot: t.TempDir()}
}

// charDevice says what is at p: a character device's numbers and mode.
func charDevice(t *testing.T, p string) (ok bool, major, minor uint32, mode uint32) {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Lstat(p, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return false, 0, 0, 0
		}
		t.Fatal(err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFCHR {
		t.Fatalf("%s is not a character device (mode %o)", p, st.Mode)
	}
	return true, unix.Major(st.Rdev), unix.Minor(st.Rdev), st.Mode & 0o777
}

func records(t *testing.T, n *hostnodes.Nodes) []string {
	t.Helper()
	m, _ := filepath.Glob(filepath.Join(n.Dir, "*.json"))
	return m
}

// TestNodesAreMadeWhenNeededAndRemovedAfter: with the real mknod, a
// claim's capability and channel nodes are made with their numbers and the
// modes the driver's tools give them, a GPU node is left to the driver, and
// release removes what was made and the record.
func TestNodesAreMadeWhenNeededAndRemovedAfter(t *testing.T) {
	n := newNodes(t, gpulib.Mknod{})
	ctx := context.Background()
	if err := n.Ensure(ctx, "claim-a", []cdi.DeviceNode{gpuNode, capNode, channelNode}); err != nil {
		t.Fatal(err)
	}
	for _, want := range []struct {
		node cdi.DeviceNode
		mode uint32
	}{{capNode, 0o444}, {channelNode, 0o666}} {
		ok, major, minor, mode := charDevice(t, filepath.Join(n.DevRoot, want.node.Path))
		if !ok || int64(major) != want.node.Major || int64(minor) != want.node.Minor || mode != want.mode {
			t.Errorf("%s: present %v, %d:%d mode %o; want %d:%d mode %o", want.node.Path, ok, major, minor, mode, want.node.Major, want.node.Minor, want.mode)
		}
	}
	if _, err := os.Lstat(filepath.Join(n.DevRoot, gpuNode.Path)); err == nil {
		t.Error("the GPU's own node was made: that is the driver's")
	}
	// Idempotent: a retried prepare changes nothing.
	if err := n.Ensure(ctx, "claim-a", []cdi.DeviceNode{capNode, channelNode}); err != nil {
		t.Fatal(err)
	}
	if err := n.Release(ctx, "claim-a"); err != nil {
		t.Fatal(err)
	}
	for _, d := range []cdi.DeviceNode{capNode, channelNode} {
		if ok, _, _, _ := charDevice(t, filepath.Join(n.DevRoot, d.Path)); ok {
			t.Errorf("%s left after release", d.Path)
		}
	}
	if r := records(t, n); len(r) != 0 {
		t.Errorf("records left: %v", r)
	}
	if err := n.Release(ctx, "claim-a"); err != nil {
		t.Errorf("a second release: %v", err)
	}
}

// TestANodeThatWasThereIsNeverRemoved: the driver's (or an operator's)
// node is used, not recorded, and stays after release.
func TestANodeThatWasThereIsNeverRemoved(t *testing.T) {
	n := newNodes(t, gpulib.Mknod{})
	ctx := context.Background()
	p := filepath.Join(n.DevRoot, capNode.Path)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := (gpulib.Mknod{}).Make(p, 236, 21, 0o400); err != nil {
		t.Fatal(err)
	}
	if err := n.Ensure(ctx, "claim-a", []cdi.DeviceNode{capNode}); err != nil {
		t.Fatal(err)
	}
	if err := n.Release(ctx, "claim-a"); err != nil {
		t.Fatal(err)
	}
	if ok, _, _, mode := charDevice(t, p); !ok || mode != 0o400 {
		t.Errorf("the node that was there: present %v, mode %o", ok, mode)
	}
}

// TestASharedNodeStaysUntilItsLastClaimLeaves: two gang members on a node
// share IMEX channel 0.
func TestASharedNodeStaysUntilItsLastClaimLeaves(t *testing.T) {
	n := newNodes(t, gpulib.Mknod{})
	ctx := context.Background()
	p := filepath.Join(n.DevRoot, channelNode.Path)
	for _, owner := range []string{"member-0", "member-1"} {
		if err := n.Ensure(ctx, owner, []cdi.DeviceNode{channelNode}); err != nil {
			t.Fatal(err)
		}
	}
	if err := n.Release(ctx, "member-0"); err != nil {
		t.Fatal(err)
	}
	if ok, _, _, _ := charDevice(t, p); !ok {
		t.Fatal("the channel went with the first member; the second still needs it")
	}
	if err := n.Release(ctx, "member-1"); err != nil {
		t.Fatal(err)
	}
	if ok, _, _, _ := charDevice(t, p); ok {
		t.Error("the channel outlived its last claim")
	}
}

func TestANodeWithOtherNumbersIsRefused(t *testing.T) {
	n := newNodes(t, gpulib.Mknod{})
	p := filepath.Join(n.DevRoot, channelNode.Path)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := (gpulib.Mknod{}).Make(p, 240, 0, 0o666); err != nil {
		t.Fatal(err)
	}
	err := n.Ensure(context.Background(), "claim-a", []cdi.DeviceNode{channelNode})
	if err == nil {
		t.Fatal("no error")
	}
	if ok, major, _, _ := charDevice(t, p); !ok || major != 240 {
		t.Error("the other node was touched")
	}
}

// failingMaker records like the real one but fails to make nodes: a crash
// between the record and mknod looks the same to the next start.
type failingMaker struct{ gpulib.Mknod }

func (failingMaker) Make(string, uint32, uint32, os.FileMode) error {
	return errors.New("injected: mknod failed")
}

// TestACrashBetweenRecordAndMknodIsSweptAtStart: the record names a node
// never made; the start's sweep releases the record of a claim without a
// spec, removes nothing it did not make, and keeps the records of claims
// that have one.
func TestACrashBetweenRecordAndMknodIsSweptAtStart(t *testing.T) {
	n := newNodes(t, failingMaker{})
	ctx := context.Background()
	if err := n.Ensure(ctx, "crashed", []cdi.DeviceNode{capNode}); err == nil {
		t.Fatal("the injected failure did not fail Ensure")
	}
	if len(records(t, n)) != 1 {
		t.Fatal("no record was written before the node")
	}
	n.Maker = gpulib.Mknod{} // the restarted plugin
	if err := n.Ensure(ctx, "prepared", []cdi.DeviceNode{channelNode}); err != nil {
		t.Fatal(err)
	}
	if err := n.Sweep(ctx, func(owner string) bool { return owner == "prepared" }); err != nil {
		t.Fatal(err)
	}
	got := records(t, n)
	if len(got) != 1 || filepath.Base(got[0]) != "prepared.json" {
		t.Errorf("records after the sweep: %v, want prepared's alone", got)
	}
	if ok, _, _, _ := charDevice(t, filepath.Join(n.DevRoot, channelNode.Path)); !ok {
		t.Error("the sweep removed a kept claim's node")
	}
}

func TestANilNodesDoesNothing(t *testing.T) {
	var n *hostnodes.Nodes
	ctx := context.Background()
	if err := n.Ensure(ctx, "a", []cdi.DeviceNode{capNode}); err != nil {
		t.Error(err)
	}
	if err := n.Release(ctx, "a"); err != nil {
		t.Error(err)
	}
	if err := n.Sweep(ctx, func(string) bool { return false }); err != nil {
		t.Error(err)
	}
}
