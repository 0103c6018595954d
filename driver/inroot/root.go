package inroot

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"strings"

	"golang.org/x/sys/unix"
)

// Root is a directory tree opened as if it were "/", for a program that
// must treat every file in it as written by an attacker (the CDI hook in a
// container's root file system): every path is resolved by the kernel
// inside the tree (openat2 with RESOLVE_IN_ROOT: symlinks are followed, but
// absolute targets and ".." stop at the tree's root, and magic links such
// as /proc/self/root are refused), files are opened without blocking and
// read only when regular and no larger than asked, and directories are
// held open, so that what is written goes where the directory was when it
// was resolved, whatever is renamed or swapped meanwhile.
type Root struct{ fd int }

// OpenRoot opens dir as a Root.
func OpenRoot(dir string) (*Root, error) {
	fd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: dir, Err: err}
	}
	return &Root{fd: fd}, nil
}

// Close releases the root.
func (r *Root) Close() error { return unix.Close(r.fd) }

// resolveFlags are how every path inside the root is resolved.
const resolveFlags = unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS

// open opens rel (a path inside the root) with flags.
func (r *Root) open(rel string, flags int) (int, error) {
	how := unix.OpenHow{Flags: uint64(flags | unix.O_CLOEXEC), Resolve: resolveFlags}
	for {
		fd, err := unix.Openat2(r.fd, "/"+strings.TrimLeft(rel, "/"), &how)
		if errors.Is(err, unix.EINTR) || errors.Is(err, unix.EAGAIN) {
			// EAGAIN: a rename elsewhere raced the lookup; the kernel
			// asks for a retry.
			continue
		}
		if err != nil {
			return -1, &os.PathError{Op: "open", Path: rel, Err: err}
		}
		return fd, nil
	}
}

// Dir is a directory inside a Root, held open.
type Dir struct {
	fd   int
	name string // its path inside the root, for messages
}

// OpenDir opens the directory rel inside the root.
func (r *Root) OpenDir(rel string) (*Dir, error) {
	fd, err := r.open(rel, unix.O_PATH|unix.O_DIRECTORY)
	if err != nil {
		return nil, err
	}
	return &Dir{fd: fd, name: path.Clean("/" + rel)}, nil
}

// Close releases the directory.
func (d *Dir) Close() error { return unix.Close(d.fd) }

// ErrNotRegular is returned for a file that is not a regular file (a FIFO,
// a device, a directory, a socket): nothing reads those.
var ErrNotRegular = errors.New("not a regular file")

// ErrTooLarge is returned for a file larger than the caller allows.
var ErrTooLarge = errors.New("larger than allowed")

// OpenFile opens the regular file rel inside the root for reading, without
// blocking (a FIFO is refused, not waited on), and checks that it is at
// most max bytes. The caller closes it.
func (r *Root) OpenFile(rel string, max int64) (*os.File, error) {
	fd, err := r.open(rel, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_NOCTTY)
	if err != nil {
		return nil, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		_ = unix.Close(fd)
		return nil, &os.PathError{Op: "stat", Path: rel, Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		_ = unix.Close(fd)
		return nil, &os.PathError{Op: "open", Path: rel, Err: fmt.Errorf("%w (%s)", ErrNotRegular, fileType(st.Mode))}
	}
	if st.Size > max {
		_ = unix.Close(fd)
		return nil, &os.PathError{Op: "open", Path: rel, Err: fmt.Errorf("%w: %d bytes, at most %d", ErrTooLarge, st.Size, max)}
	}
	return os.NewFile(uintptr(fd), rel), nil
}

// ReadFile reads the regular file rel inside the root, at most max bytes
// (OpenFile); a file that grows past max while read is refused too.
func (r *Root) ReadFile(rel string, max int64) ([]byte, error) {
	f, err := r.OpenFile(rel, max)
	if err != nil {
		return nil, err
	}
	defer func() { _ = f.Close() }()
	data, err := io.ReadAll(io.LimitReader(f, max+1))
	if err != nil {
		return nil, &os.PathError{Op: "read", Path: rel, Err: err}
	}
	if int64(len(data)) > max {
		return nil, &os.PathError{Op: "read", Path: rel, Err: fmt.Errorf("%w: grew past %d bytes while read", ErrTooLarge, max)}
	}
	return data, nil
}

// Exists says whether the directory has an entry name, of any type; a
// symlink there is not followed.
func (d *Dir) Exists(name string) (bool, error) {
	var st unix.Stat_t
	err := unix.Fstatat(d.fd, name, &st, unix.AT_SYMLINK_NOFOLLOW)
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, unix.ENOENT):
		return false, nil
	}
	return false, &os.PathError{Op: "stat", Path: path.Join(d.name, name), Err: err}
}

// Symlink creates the symlink name -> target in the directory.
func (d *Dir) Symlink(target, name string) error {
	if err := unix.Symlinkat(target, d.fd, name); err != nil {
		return &os.PathError{Op: "symlink", Path: path.Join(d.name, name), Err: err}
	}
	return nil
}

// WriteFile replaces the directory's entry name (whatever it is: a file, a
// symlink, which is replaced and not followed) with a regular file of data
// and mode perm, through a new file beside it renamed over it, so that
// readers see the old content or the new, never a part.
func (d *Dir) WriteFile(name string, data []byte, perm uint32) error {
	if name == "" || strings.Contains(name, "/") || name == "." || name == ".." {
		return fmt.Errorf("write %q in %s: want a name in the directory", name, d.name)
	}
	full := path.Join(d.name, name)
	var tmp string
	var fd int
	for i := 0; ; i++ {
		tmp = fmt.Sprintf(".%s.tessera-%d-%d", name, os.Getpid(), i)
		var err error
		fd, err = unix.Openat(d.fd, tmp, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
		if errors.Is(err, unix.EEXIST) && i < 100 {
			continue
		}
		if err != nil {
			return &os.PathError{Op: "create", Path: full, Err: err}
		}
		break
	}
	f := os.NewFile(uintptr(fd), tmp)
	remove := func() { _ = unix.Unlinkat(d.fd, tmp, 0) }
	if _, err := f.Write(data); err != nil {
		_ = f.Close()
		remove()
		return &os.PathError{Op: "write", Path: full, Err: err}
	}
	if err := f.Chmod(os.FileMode(perm)); err != nil {
		_ = f.Close()
		remove()
		return &os.PathError{Op: "chmod", Path: full, Err: err}
	}
	if err := f.Close(); err != nil {
		remove()
		return &os.PathError{Op: "write", Path: full, Err: err}
	}
	if err := unix.Renameat(d.fd, tmp, d.fd, name); err != nil {
		remove()
		return &os.PathError{Op: "rename", Path: full, Err: err}
	}
	return nil
}

// fileType names a file mode's type for messages.
func fileType(mode uint32) string {
	switch mode & unix.S_IFMT {
	case unix.S_IFIFO:
		return "a FIFO"
	case unix.S_IFCHR:
		return "a character device"
	case unix.S_IFBLK:
		return "a block device"
	case unix.S_IFDIR:
		return "a directory"
	case unix.S_IFSOCK:
		return "a socket"
	case unix.S_IFLNK:
		return "a symlink"
	}
	return "not a regular file"
}
