package nodelock_test

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"go.etcd.io/etcd/client/pkg/v3/fileutil"

	"github.com/tessera-dev/tessera/driver/nodelock"
)

// TestAClaimLockExcludesTheOtherInstanceOnly: one instance holding a claim's
// lock keeps the other from it, not from another claim's, and lets it in
// once released.
func TestAClaimLockExcludesTheOtherInstanceOnly(t *testing.T) {
	dir := t.TempDir()
	a, b := nodelock.New(dir), nodelock.New(dir)
	unlock, err := a.LockClaim("uid-1")
	if err != nil {
		t.Fatal(err)
	}
	if _, ok, err := b.TryLockClaim("uid-1"); ok || err != nil {
		t.Fatalf("the other instance took a held claim's lock (ok %v, err %v)", ok, err)
	}
	other, ok, err := b.TryLockClaim("uid-2")
	if !ok || err != nil {
		t.Fatalf("another claim's lock was not free (ok %v, err %v)", ok, err)
	}
	other()
	done := make(chan error)
	go func() {
		u, err := b.LockClaim("uid-1")
		if err == nil {
			u()
		}
		done <- err
	}()
	unlock()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestTheNodeLockIsExclusive: while one instance holds the node lock, the
// file is locked to anyone else (kubeletplugin of an earlier release
// included, which locks it with fileutil).
func TestTheNodeLockIsExclusive(t *testing.T) {
	dir := t.TempDir()
	unlock, err := nodelock.New(dir).LockNode()
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, nodelock.NodeFile)
	if f, err := fileutil.TryLockFile(path, os.O_RDWR, 0o600); !errors.Is(err, fileutil.ErrLocked) {
		if f != nil {
			_ = f.Close()
		}
		t.Fatalf("a held node lock could be taken again: %v", err)
	}
	unlock()
	f, err := fileutil.TryLockFile(path, os.O_RDWR, 0o600)
	if err != nil {
		t.Fatalf("the released node lock: %v", err)
	}
	_ = f.Close()
}
