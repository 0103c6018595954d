// Package inroot resolves paths inside a directory tree as if that tree were
// "/": symlinks are followed, absolute link targets start at the tree's root,
// and ".." stops there. The driver-file discovery reads a driver root whose
// links are written for another root (Resolve: by name, for a tree the node
// owns); the CDI hook reads and writes a container's root file system, every
// file of which an attacker may have written and may swap while the hook
// runs (Root: resolved by the kernel, opened without blocking, regular files
// of bounded size only, directories held open).
package inroot

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
	"syscall"
)

// MaxLinks bounds symlink resolution, as the kernel does (ELOOP).
const MaxLinks = 40

// Resolve resolves rel inside root as if root were "/". It returns the
// resolved path relative to root, clean and without a leading slash ("" for
// root itself). Every component must exist.
func Resolve(root, rel string) (string, error) {
	var (
		done    []string
		pending = strings.Split(rel, "/")
		links   = 0
	)
	for len(pending) > 0 {
		c := pending[0]
		pending = pending[1:]
		switch c {
		case "", ".":
			continue
		case "..":
			if len(done) > 0 {
				done = done[:len(done)-1]
			}
			continue
		}
		cur := path.Join(append(done, c)...)
		fi, err := os.Lstat(filepath.Join(root, cur))
		if err != nil {
			return "", err
		}
		if fi.Mode()&fs.ModeSymlink == 0 {
			done = append(done, c)
			continue
		}
		if links++; links > MaxLinks {
			return "", fmt.Errorf("/%s: more than %d symlinks", cur, MaxLinks)
		}
		target, err := os.Readlink(filepath.Join(root, cur))
		if err != nil {
			return "", err
		}
		if path.IsAbs(target) {
			done = done[:0]
		}
		pending = append(strings.Split(target, "/"), pending...)
	}
	return path.Join(done...), nil
}

// ResolveParent resolves the directory of rel inside root and keeps its last
// component as it is: the path of rel itself, not of what a link there points
// to. It is what a program creating or replacing rel inside root needs.
func ResolveParent(root, rel string) (string, error) {
	rel = path.Clean("/" + rel)
	if rel == "/" {
		return "", errors.New("the root itself has no parent")
	}
	dir, err := Resolve(root, path.Dir(rel))
	if err != nil {
		return "", err
	}
	return path.Join(dir, path.Base(rel)), nil
}

// Absent reports whether err says a path does not exist (possibly because a
// component of it is a file).
func Absent(err error) bool {
	return errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR)
}
