// Package hostnodes makes on the host the device nodes a claim's containers
// need that the NVIDIA driver creates only on demand (MIG capability nodes
// /dev/nvidia-caps/nvidia-cap<N>, IMEX channel nodes
// /dev/nvidia-caps-imex-channels/channel<N>), and removes them when no claim
// needs them any more. Runtimes that bind-mount device nodes from the host
// (user namespaces) fail without them.
//
// The contract, crash safety included:
//   - Each claim (owner) has a record, a file in Dir, listing the nodes it
//     holds: those it made and those another claim made and still holds.
//     A node that was there before any claim (the driver's, an operator's)
//     is never recorded, so never removed.
//   - Ensure writes the record, and syncs it, before it makes a node: a
//     crash in between leaves a record naming a node that may not exist,
//     and removal checks the node is there with the recorded numbers.
//   - Release removes the owner's nodes that no other record holds and
//     still have the recorded numbers, then the record. Both are idempotent.
//   - The caller writes a claim's CDI spec before Ensure and removes it
//     before Release, so a record without a spec is one a crash left behind:
//     Sweep, at start, releases those.
//   - Two plugin instances (a rolling update) share Dir; a lock file in it
//     serialises every change.
package hostnodes

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/tessera-dev/tessera/cdi"
	"github.com/tessera-dev/tessera/driver/gpulib"
)

// Nodes makes and removes the on-demand device nodes of claims. A nil
// *Nodes does nothing.
type Nodes struct {
	// Dir holds the records (one file per claim) and the lock file.
	Dir string
	// Maker makes and checks device nodes (gpulib.Node.Nodes).
	Maker gpulib.NodeMaker
	// DevRoot is the directory whose dev/ holds the host's device nodes,
	// as this process sees it (devnodes.Resolver.DevRoot); a node's Path
	// is made under it.
	DevRoot string
}

// OnDemand says whether a node is one the driver makes only on demand,
// which Ensure makes when missing.
func OnDemand(n cdi.DeviceNode) bool {
	return strings.HasPrefix(n.Path, "/dev/nvidia-caps/") || strings.HasPrefix(n.Path, "/dev/nvidia-caps-imex-channels/")
}

// node is one recorded device node.
type node struct {
	// Path is where this process sees the node.
	Path  string `json:"path"`
	Major uint32 `json:"major"`
	Minor uint32 `json:"minor"`
}

// record is a claim's file.
type record struct {
	Nodes []node `json:"nodes"`
}

const (
	lockFile = ".lock"
	suffix   = ".json"
	// Modes the driver's own tools give these nodes: capability nodes are
	// read to prove access, channels opened read-write.
	capMode     = 0o444
	channelMode = 0o666
)

// Ensure makes the on-demand nodes among nodes that are missing, for
// owner.
func (n *Nodes) Ensure(ctx context.Context, owner string, nodes []cdi.DeviceNode) error {
	if n == nil {
		return nil
	}
	var want []node
	for _, d := range nodes {
		if !OnDemand(d) {
			continue
		}
		want = append(want, node{Path: filepath.Join(n.DevRoot, d.Path), Major: uint32(d.Major), Minor: uint32(d.Minor)})
	}
	if len(want) == 0 {
		return nil
	}
	return n.withLock(true, func() error {
		records, err := n.records()
		if err != nil {
			return err
		}
		mine := records[owner]
		held := func(x node) bool {
			for o, r := range records {
				if o != owner && slices.Contains(r.Nodes, x) {
					return true
				}
			}
			return false
		}
		var toMake []node
		for _, w := range want {
			there, err := n.Maker.Is(w.Path, w.Major, w.Minor)
			if err != nil {
				return err
			}
			switch {
			case slices.Contains(mine.Nodes, w):
				if !there {
					toMake = append(toMake, w)
				}
			case there && held(w):
				mine.Nodes = append(mine.Nodes, w) // another claim's: share it
			case there:
				// The driver's or an operator's: never ours to remove.
			default:
				if _, err := os.Lstat(w.Path); err == nil {
					return fmt.Errorf("device node %s exists with other numbers than %d:%d; remove it or reload the NVIDIA driver", w.Path, w.Major, w.Minor)
				}
				mine.Nodes = append(mine.Nodes, w)
				toMake = append(toMake, w)
			}
		}
		if err := n.write(owner, mine); err != nil {
			return err
		}
		for _, w := range toMake {
			if err := os.MkdirAll(filepath.Dir(w.Path), 0o755); err != nil {
				return fmt.Errorf("make device node %s: %w", w.Path, err)
			}
			mode := os.FileMode(capMode)
			if strings.Contains(w.Path, "imex-channels") {
				mode = channelMode
			}
			if err := n.Maker.Make(w.Path, w.Major, w.Minor, mode); err != nil && !errors.Is(err, fs.ErrExist) {
				return err
			}
			klog.FromContext(ctx).V(2).Info("Made a device node on the host", "path", w.Path, "major", w.Major, "minor", w.Minor, "claim", owner)
		}
		return nil
	})
}

// Release removes owner's nodes no other claim holds, then its record.
func (n *Nodes) Release(ctx context.Context, owner string) error {
	if n == nil {
		return nil
	}
	return n.withLock(false, func() error { return n.releaseLocked(ctx, owner) })
}

func (n *Nodes) releaseLocked(ctx context.Context, owner string) error {
	records, err := n.records()
	if err != nil {
		return err
	}
	mine, ok := records[owner]
	if !ok {
		return nil
	}
	for _, x := range mine.Nodes {
		shared := false
		for o, r := range records {
			shared = shared || (o != owner && slices.Contains(r.Nodes, x))
		}
		if shared {
			continue
		}
		there, err := n.Maker.Is(x.Path, x.Major, x.Minor)
		if err != nil {
			return err
		}
		if !there {
			continue // never made (a crash), or replaced by someone else
		}
		if err := os.Remove(x.Path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("remove device node %s of claim %s: %w", x.Path, owner, err)
		}
		klog.FromContext(ctx).V(2).Info("Removed a device node from the host", "path", x.Path, "claim", owner)
	}
	if err := os.Remove(filepath.Join(n.Dir, owner+suffix)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove the device node record of claim %s: %w", owner, err)
	}
	return syncDir(n.Dir)
}

// Sweep releases the records of claims keep says no longer have a spec:
// what a crash between a spec's removal and Release, or between Ensure and
// a failed prepare's rollback, left behind. It runs at start, before any
// prepare.
func (n *Nodes) Sweep(ctx context.Context, keep func(owner string) bool) error {
	if n == nil {
		return nil
	}
	return n.withLock(false, func() error {
		records, err := n.records()
		if err != nil {
			return err
		}
		for _, o := range slices.Sorted(maps.Keys(records)) {
			if keep(o) {
				continue
			}
			klog.FromContext(ctx).Info("Releasing the device nodes of a claim that has no CDI spec", "claim", o)
			if err := n.releaseLocked(ctx, o); err != nil {
				return err
			}
		}
		return nil
	})
}

func (n *Nodes) records() (map[string]record, error) {
	entries, err := os.ReadDir(n.Dir)
	if errors.Is(err, fs.ErrNotExist) {
		return map[string]record{}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read device node records: %w", err)
	}
	out := map[string]record{}
	for _, e := range entries {
		owner, ok := strings.CutSuffix(e.Name(), suffix)
		if !ok || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		data, err := os.ReadFile(filepath.Join(n.Dir, e.Name()))
		if err != nil {
			return nil, fmt.Errorf("read device node record: %w", err)
		}
		var r record
		if err := json.Unmarshal(data, &r); err != nil {
			// A torn write cannot happen (write renames a synced
			// file); anything else is not ours to guess at.
			return nil, fmt.Errorf("device node record %s: %w; remove it once no container uses its nodes", filepath.Join(n.Dir, e.Name()), err)
		}
		out[owner] = r
	}
	return out, nil
}

// write replaces owner's record with a synced file.
func (n *Nodes) write(owner string, r record) error {
	data, err := json.Marshal(r)
	if err != nil {
		return err
	}
	tmp, err := os.CreateTemp(n.Dir, ".record-*")
	if err != nil {
		return fmt.Errorf("write the device node record of claim %s: %w", owner, err)
	}
	defer func() { _ = os.Remove(tmp.Name()) }()
	_, err = tmp.Write(data)
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), filepath.Join(n.Dir, owner+suffix))
	}
	if err != nil {
		return fmt.Errorf("write the device node record of claim %s: %w", owner, err)
	}
	return syncDir(n.Dir)
}

// withLock runs fn holding the lock file both plugin instances share,
// making Dir first if create is set; without Dir, and without create,
// there is nothing to do.
func (n *Nodes) withLock(create bool, fn func() error) error {
	if create {
		// Its parent (the plugin's data directory) must be there: a
		// directory gone with a broken disk is not made again here.
		if err := os.Mkdir(n.Dir, 0o750); err != nil && !errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("device node records: %w", err)
		}
	} else if _, err := os.Stat(n.Dir); errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	f, err := os.OpenFile(filepath.Join(n.Dir, lockFile), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("device node records: %w", err)
	}
	defer func() { _ = f.Close() }()
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		return fmt.Errorf("lock the device node records: %w", err)
	}
	defer func() { _ = unix.Flock(int(f.Fd()), unix.LOCK_UN) }()
	return fn()
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer func() { _ = d.Close() }()
	return d.Sync()
}
