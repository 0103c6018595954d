// Package nodelock holds the file locks two kubelet plugin instances share
// while they serve one node side by side (a DaemonSet rolling update): the
// node lock, held only while one of them reads or changes the node's
// prepared state (the checkpoint and the GPU settings it records), and one
// lock per claim, held for a claim's whole prepare or unprepare, slow steps
// included. Both are open file description locks, so a crashed instance's
// locks go with its process, and a lock taken twice in one process through
// two Locks (two instances in one test) excludes as between processes.
package nodelock

import (
	"errors"
	"fmt"
	"hash/fnv"
	"os"
	"path/filepath"

	"go.etcd.io/etcd/client/pkg/v3/fileutil"
	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/types"
)

// NodeFile is the node lock's file. It is the file kubeletplugin locks
// around every call when it serialises them in rolling-update mode (an
// unexported name upstream, pinned by TestTheNodeLockIsKubeletpluginsCallLock
// in driver/plugin): an instance of an earlier release, which lets
// kubeletplugin hold that lock for its whole calls, and one of this release
// then exclude each other.
const NodeFile = "serialize.lock"

// ClaimsFile holds the claim locks: each claim locks one byte of it, at an
// offset hashed from its UID. Two claims that hash alike (one chance in
// 2^62 a pair) only wait for each other.
const ClaimsFile = "claims.lock"

// Locks are the locks of the node whose plugin data directory they live in.
type Locks struct {
	dir string
}

// New returns the locks kept in dir, the plugin data directory both
// instances share.
func New(dir string) *Locks { return &Locks{dir: dir} }

// LockNode waits for the node lock.
func (l *Locks) LockNode() (unlock func(), err error) {
	path := filepath.Join(l.dir, NodeFile)
	f, err := fileutil.LockFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("lock %s: %w", path, err)
	}
	return func() { _ = f.Close() }, nil
}

// LockClaim waits for the claim's lock.
func (l *Locks) LockClaim(uid types.UID) (unlock func(), err error) {
	unlock, _, err = l.lockClaim(uid, true)
	return unlock, err
}

// TryLockClaim takes the claim's lock unless another holds it (ok false:
// the claim's prepare or unprepare is under way in the other instance).
func (l *Locks) TryLockClaim(uid types.UID) (unlock func(), ok bool, err error) {
	return l.lockClaim(uid, false)
}

func (l *Locks) lockClaim(uid types.UID, wait bool) (func(), bool, error) {
	path := filepath.Join(l.dir, ClaimsFile)
	// A file of its own for each lock: locks of one open file description
	// never exclude each other.
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, false, fmt.Errorf("claim %s: open lock file: %w", uid, err)
	}
	h := fnv.New64a()
	_, _ = h.Write([]byte(uid))
	lk := unix.Flock_t{Type: unix.F_WRLCK, Whence: 0, Start: int64(h.Sum64() >> 2), Len: 1}
	cmd := unix.F_OFD_SETLKW
	if !wait {
		cmd = unix.F_OFD_SETLK
	}
	for {
		err = unix.FcntlFlock(f.Fd(), cmd, &lk)
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	if !wait && (errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EACCES)) {
		_ = f.Close()
		return nil, false, nil
	}
	if err != nil {
		_ = f.Close()
		return nil, false, fmt.Errorf("claim %s: lock %s: %w", uid, path, err)
	}
	return func() { _ = f.Close() }, true, nil
}
