// Package cdihook is what tessera-cdi-hook does as a container's
// createContainer hook: it finds the container's root file system from the
// OCI state the runtime hands it, links the driver libraries the CDI spec
// mounted under the names programs open (libcuda.so -> libcuda.so.1 ->
// libcuda.so.<version>), and adds them to the container's loader cache, so
// that an image whose loader looks elsewhere (a /usr/lib64 image on a Debian
// host) still finds libcuda.so.1.
//
// It writes the loader cache itself (package ldcache) rather than running
// ldconfig: the only ldconfig at hand as the hook runs is the image's, and
// running a binary of the image as root in the runtime's namespaces, before
// the container's own confinement applies, would run the image's code with
// the host's privileges. Writing the cache needs no binary of the image, of
// the host or of NVIDIA, works in images without ldconfig, and changes only
// the entries it adds. Every file of the image is treated as written by an
// attacker, who may also swap it while the hook runs (a volume shared with a
// running sidecar): every path inside the container is resolved by the
// kernel as if its root were "/" (inroot.Root: openat2 with RESOLVE_IN_ROOT),
// so links in the image cannot lead the hook out of it; files are read only
// when regular and of bounded size, opened without blocking (a FIFO is
// refused, not waited on); writes go through directories held open; and the
// cache is parsed in time and memory linear in its size (package ldcache).
package cdihook

import (
	"debug/elf"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path"
	"path/filepath"
	"runtime"
	"slices"
	"strings"

	oci "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/tessera-dev/tessera/driver/cdihook/ldcache"
	"github.com/tessera-dev/tessera/driver/inroot"
)

// ConfFile is the loader configuration the hook writes, so that an ldconfig
// run later in the container (a package install) keeps the driver's
// libraries in the cache. It sorts first, as ldconfig prefers the
// directories it reads first.
const ConfFile = "/etc/ld.so.conf.d/000-tessera-driver.conf"

// cacheFile is the loader cache every glibc loader reads.
const cacheFile = "/etc/ld.so.cache"

// Link is a symlink to create in the container: Path (a container path) ->
// Target (as the link's content).
type Link struct{ Path, Target string }

// ParseLink reads PATH=TARGET.
func ParseLink(s string) (Link, error) {
	p, target, ok := strings.Cut(s, "=")
	if !ok || !path.IsAbs(p) || target == "" {
		return Link{}, fmt.Errorf("link %q: want /path/in/container=target", s)
	}
	return Link{Path: path.Clean(p), Target: target}, nil
}

// Request is one run of the hook.
type Request struct {
	// Links are created where nothing is; an existing file or link is
	// left alone.
	Links []Link
	// Libraries are container paths the loader cache maps their names to.
	Libraries []string
}

// RootFS reads the OCI state (the runtime writes it to the hook's stdin)
// and returns the container's root file system as the hook sees it.
func RootFS(state io.Reader) (string, error) {
	var s oci.State
	if err := json.NewDecoder(state).Decode(&s); err != nil {
		return "", fmt.Errorf("read the container's state from stdin: %w", err)
	}
	if s.Bundle == "" {
		return "", errors.New("the container's state names no bundle")
	}
	data, err := os.ReadFile(filepath.Join(s.Bundle, "config.json"))
	if err != nil {
		return "", fmt.Errorf("read the container's config: %w", err)
	}
	var spec oci.Spec
	if err := json.Unmarshal(data, &spec); err != nil {
		return "", fmt.Errorf("read the container's config %s: %w", filepath.Join(s.Bundle, "config.json"), err)
	}
	if spec.Root == nil || spec.Root.Path == "" {
		return "", fmt.Errorf("the container's config in %s names no root file system", s.Bundle)
	}
	root := spec.Root.Path
	if !filepath.IsAbs(root) {
		root = filepath.Join(s.Bundle, root)
	}
	return root, nil
}

// Limits on what the hook reads from the image: a loader cache larger than
// MaxCacheSize is refused (a real one is tens to hundreds of kilobytes).
const MaxCacheSize = 8 << 20

// Apply makes the links and updates the loader cache in the container whose
// root file system is root. Running it again changes nothing.
func Apply(root string, r Request) error {
	fsys, err := inroot.OpenRoot(root)
	if err != nil {
		return fmt.Errorf("the container's root file system: %w", err)
	}
	defer func() { _ = fsys.Close() }()
	for _, l := range r.Links {
		if err := link(fsys, l); err != nil {
			return err
		}
	}
	if len(r.Libraries) == 0 {
		return nil
	}
	var entries []ldcache.Entry
	var dirs []string
	for _, lib := range r.Libraries {
		flags, err := flagsOf(fsys, lib)
		if err != nil {
			return fmt.Errorf("library %s in the container: %w", lib, err)
		}
		entries = append(entries, ldcache.Entry{Key: path.Base(lib), Value: lib, Flags: flags})
		if d := path.Dir(lib); !slices.Contains(dirs, d) {
			dirs = append(dirs, d)
		}
	}
	slices.Sort(dirs)
	if err := writeConf(fsys, dirs); err != nil {
		return err
	}
	return updateCache(fsys, entries)
}

// link creates l unless something is at its path already.
func link(fsys *inroot.Root, l Link) error {
	dir, err := fsys.OpenDir(path.Dir(l.Path))
	if err != nil {
		return fmt.Errorf("link %s in the container: %w", l.Path, err)
	}
	defer func() { _ = dir.Close() }()
	name := path.Base(l.Path)
	if there, err := dir.Exists(name); err != nil || there {
		return err
	}
	if err := dir.Symlink(l.Target, name); err != nil && !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("link %s -> %s in the container: %w", l.Path, l.Target, err)
	}
	return nil
}

// writeConf lists the library directories in ConfFile, where the image
// keeps loader configuration directories.
func writeConf(fsys *inroot.Root, dirs []string) error {
	dir, err := fsys.OpenDir(path.Dir(ConfFile))
	if inroot.Absent(err) {
		return nil // no /etc/ld.so.conf.d: the image does not use one
	}
	if err != nil {
		return fmt.Errorf("%s in the container: %w", ConfFile, err)
	}
	defer func() { _ = dir.Close() }()
	return dir.WriteFile(path.Base(ConfFile), []byte(strings.Join(dirs, "\n")+"\n"), 0o644)
}

// updateCache sets entries in the container's loader cache, creating it
// when the image has none. The cache is read as the loader would find it
// (a link inside the image followed) and written in /etc as it was when
// resolved.
func updateCache(fsys *inroot.Root, entries []ldcache.Entry) error {
	dir, err := fsys.OpenDir(path.Dir(cacheFile))
	if inroot.Absent(err) {
		return nil // no /etc: an image without a glibc loader (scratch, static)
	}
	if err != nil {
		return fmt.Errorf("%s in the container: %w", cacheFile, err)
	}
	defer func() { _ = dir.Close() }()
	cache := &ldcache.Cache{}
	data, err := fsys.ReadFile(cacheFile, MaxCacheSize)
	switch {
	case err == nil:
		if cache, err = ldcache.Parse(data); err != nil {
			return fmt.Errorf("%s in the container: %w", cacheFile, err)
		}
	case inroot.Absent(err):
	default:
		return fmt.Errorf("read %s in the container (the hook reads only a regular file of at most %d bytes there): %w", cacheFile, MaxCacheSize, err)
	}
	cache.Set(entries...)
	return dir.WriteFile(path.Base(cacheFile), cache.Marshal(), 0o644)
}

// flagsOf are the loader cache flags of the library lib: those of its ELF
// machine, or of this program's architecture when lib is no ELF file (the
// hook runs on the node, whose architecture the driver's is). Only the ELF
// header is read.
func flagsOf(fsys *inroot.Root, lib string) (int32, error) {
	f, err := fsys.OpenFile(lib, math.MaxInt64)
	if err != nil {
		return 0, err
	}
	defer func() { _ = f.Close() }()
	machine := map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64}[runtime.GOARCH]
	var h [20]byte // e_ident, e_type, e_machine
	if _, err := io.ReadFull(f, h[:]); err == nil && string(h[:4]) == elf.ELFMAG {
		order := binary.ByteOrder(binary.LittleEndian)
		if elf.Data(h[elf.EI_DATA]) == elf.ELFDATA2MSB {
			order = binary.BigEndian
		}
		machine = elf.Machine(order.Uint16(h[18:]))
	}
	if machine == elf.EM_AARCH64 {
		return ldcache.FlagAArch64, nil
	}
	return ldcache.FlagX8664Lib64, nil
}
