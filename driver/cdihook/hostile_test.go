package cdihook_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tessera-dev/tessera/driver/cdihook"
	"github.com/tessera-dev/tessera/driver/cdihook/ldcache"
	"github.com/tessera-dev/tessera/driver/inroot"
)

// applyWithin runs the hook on bundle and fails the test if it does not
// return within a minute: a hook that blocks (on a FIFO, a device) would
// hold the container's creation, and each kubelet retry would leave another
// runtime stuck.
func applyWithin(t *testing.T, bundle string) error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- cdihook.Main(hookArgs, state(t, bundle)) }()
	select {
	case err := <-done:
		return err
	case <-time.After(time.Minute):
		t.Fatal("the hook blocked")
		return nil
	}
}

// hostCache is a loader cache outside the container's root, as a host file
// an image's link could point to, holding an entry no image has.
func hostCache(t *testing.T) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "ld.so.cache")
	c := &ldcache.Cache{}
	c.Set(ldcache.Entry{Key: "libhostsecret.so.1", Value: "/host/only/libhostsecret.so.1", Flags: ldcache.FlagX8664Lib64})
	if err := os.WriteFile(p, c.Marshal(), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestTheImagesLoaderCacheIsReadOnlyInsideItsRootAndOnlyWhenRegular: an
// image's /etc/ld.so.cache that is a link to a host file (absolute, or
// through ..) is resolved inside the container's root, so the host file's
// entries never reach the container and the host file is untouched; a FIFO
// there fails the hook at once instead of blocking it; a device node (the
// host's /dev/zero's numbers) and a cache larger than the hook reads fail it
// naming the file. Nothing outside the root is written.
func TestTheImagesLoaderCacheIsReadOnlyInsideItsRootAndOnlyWhenRegular(t *testing.T) {
	for _, tc := range []struct {
		name    string
		plant   func(t *testing.T, cache string)
		wantErr string // empty: the hook succeeds
	}{
		{"an absolute link to a host file", func(t *testing.T, cache string) {
			if err := os.Symlink(hostCache(t), cache); err != nil {
				t.Fatal(err)
			}
		}, ""},
		{"a relative link climbing out", func(t *testing.T, cache string) {
			if err := os.Symlink(strings.Repeat("../", 40)+strings.TrimPrefix(hostCache(t), "/"), cache); err != nil {
				t.Fatal(err)
			}
		}, ""},
		{"a FIFO", func(t *testing.T, cache string) {
			if err := unix.Mkfifo(cache, 0o644); err != nil {
				t.Fatal(err)
			}
		}, "a FIFO"},
		{"a character device", func(t *testing.T, cache string) {
			if err := unix.Mknod(cache, unix.S_IFCHR|0o644, int(unix.Mkdev(1, 5))); err != nil {
				t.Fatal(err)
			}
		}, "a character device"},
		{"larger than the hook reads", func(t *testing.T, cache string) {
			if err := os.WriteFile(cache, nil, 0o644); err != nil {
				t.Fatal(err)
			}
			if err := os.Truncate(cache, cdihook.MaxCacheSize+1); err != nil {
				t.Fatal(err)
			}
		}, "larger than allowed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bundle, root := image(t)
			cache := filepath.Join(root, "etc/ld.so.cache")
			tc.plant(t, cache)
			var hostBefore []byte
			if target, err := os.Readlink(cache); err == nil {
				abs := target
				if !filepath.IsAbs(abs) {
					abs = filepath.Join(filepath.Dir(cache), target)
				}
				hostBefore, _ = os.ReadFile(abs)
				defer func() {
					if after, _ := os.ReadFile(abs); string(after) != string(hostBefore) {
						t.Errorf("the host file %s the image's link points to was changed", abs)
					}
				}()
			}
			err := applyWithin(t, bundle)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) || !strings.Contains(err.Error(), "/etc/ld.so.cache") {
					t.Fatalf("hook: %v, want an error naming /etc/ld.so.cache and %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			got := readCache(t, cache)
			if _, leaked := got["libhostsecret.so.1"]; leaked {
				t.Errorf("the host file's entries reached the container's cache: %v", got)
			}
			if got["libcuda.so.1"] != "/usr/lib64/libcuda.so.1" {
				t.Errorf("cache entries %v, want libcuda.so.1", got)
			}
			if fi, err := os.Lstat(cache); err != nil || !fi.Mode().IsRegular() {
				t.Errorf("the container's cache is %v (%v), want the hook's regular file in place of the link", fi.Mode(), err)
			}
		})
	}
}

// TestWritesGoWhereTheDirectoryWasWhenResolved: a directory held open by the
// hook and then swapped for a link to a host directory (a sidecar sharing
// the volume, between the hook's resolution and its write) still receives
// the write; the host directory gets nothing. The hook writes its files and
// links only through directories it holds open (cdihook.Apply).
func TestWritesGoWhereTheDirectoryWasWhenResolved(t *testing.T) {
	root := t.TempDir()
	outside := t.TempDir()
	mkdir(t, filepath.Join(root, "etc"))
	fsys, err := inroot.OpenRoot(root)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = fsys.Close() }()
	dir, err := fsys.OpenDir("/etc")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = dir.Close() }()
	if err := os.Rename(filepath.Join(root, "etc"), filepath.Join(root, "etc.old")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(root, "etc")); err != nil {
		t.Fatal(err)
	}
	if err := dir.WriteFile("ld.so.cache", []byte("cache"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := dir.Symlink("libcuda.so.1", "libcuda.so"); err != nil {
		t.Fatal(err)
	}
	if entries, _ := os.ReadDir(outside); len(entries) != 0 {
		t.Errorf("the write followed the swapped link to the host: %v", entries)
	}
	if data, err := os.ReadFile(filepath.Join(root, "etc.old/ld.so.cache")); err != nil || string(data) != "cache" {
		t.Errorf("the held directory's file: %q (%v)", data, err)
	}
	// Reads resolve inside the root: the swapped link's absolute target is
	// looked up under the root, where nothing is.
	if _, err := fsys.ReadFile("/etc/ld.so.cache", 1<<20); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("reading through the swapped link: %v, want not found inside the root", err)
	}
}
