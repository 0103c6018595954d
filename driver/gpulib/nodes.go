package gpulib

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// NodeMaker makes character device nodes on the host: mknod on a real
// node; a fake node writes regular files standing in for them, as it does
// for every device node.
type NodeMaker interface {
	// Make creates a character device node at path (its directory exists).
	Make(path string, major, minor uint32, mode os.FileMode) error
	// Is says whether path is a device node with these numbers (as Make
	// makes them); false when nothing is there.
	Is(path string, major, minor uint32) (bool, error)
}

// Mknod is the real host's NodeMaker.
type Mknod struct{}

// Make creates the node with mknod(2).
func (Mknod) Make(path string, major, minor uint32, mode os.FileMode) error {
	if err := unix.Mknod(path, unix.S_IFCHR|uint32(mode.Perm()), int(unix.Mkdev(major, minor))); err != nil {
		return fmt.Errorf("mknod %s (%d:%d): %w", path, major, minor, err)
	}
	// mknod applies the umask; the mode is what is asked for.
	if err := os.Chmod(path, mode.Perm()); err != nil {
		return fmt.Errorf("mknod %s: %w", path, err)
	}
	return nil
}

// Is stats path.
func (Mknod) Is(path string, major, minor uint32) (bool, error) {
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return false, nil
		}
		return false, fmt.Errorf("stat %s: %w", path, err)
	}
	return st.Mode&unix.S_IFMT == unix.S_IFCHR && unix.Major(st.Rdev) == major && unix.Minor(st.Rdev) == minor, nil
}
