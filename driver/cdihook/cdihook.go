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
// the entries it adds. Every path inside the container is resolved as if
// its root were "/" (package inroot), so links in the image cannot lead the
// hook out of it.
package cdihook

import (
	"debug/elf"
	"encoding/json"
	"errors"
	"fmt"
	"io"
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

// Apply makes the links and updates the loader cache in the container whose
// root file system is root. Running it again changes nothing.
func Apply(root string, r Request) error {
	for _, l := range r.Links {
		if err := link(root, l); err != nil {
			return err
		}
	}
	if len(r.Libraries) == 0 {
		return nil
	}
	var entries []ldcache.Entry
	var dirs []string
	for _, lib := range r.Libraries {
		rel, err := inroot.Resolve(root, lib)
		if err != nil {
			return fmt.Errorf("library %s in the container: %w", lib, err)
		}
		entries = append(entries, ldcache.Entry{Key: path.Base(lib), Value: lib, Flags: flagsOf(filepath.Join(root, rel))})
		if d := path.Dir(lib); !slices.Contains(dirs, d) {
			dirs = append(dirs, d)
		}
	}
	slices.Sort(dirs)
	if err := writeConf(root, dirs); err != nil {
		return err
	}
	return updateCache(root, entries)
}

// link creates l unless something is at its path already.
func link(root string, l Link) error {
	rel, err := inroot.ResolveParent(root, l.Path)
	if err != nil {
		return fmt.Errorf("link %s in the container: %w", l.Path, err)
	}
	p := filepath.Join(root, rel)
	if _, err := os.Lstat(p); err == nil {
		return nil
	}
	if err := os.Symlink(l.Target, p); err != nil && !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("link %s -> %s in the container: %w", l.Path, l.Target, err)
	}
	return nil
}

// writeConf lists the library directories in ConfFile, where the image
// keeps loader configuration directories.
func writeConf(root string, dirs []string) error {
	rel, err := inroot.ResolveParent(root, ConfFile)
	if inroot.Absent(err) {
		return nil // no /etc/ld.so.conf.d: the image does not use one
	}
	if err != nil {
		return fmt.Errorf("%s in the container: %w", ConfFile, err)
	}
	return writeAtomic(filepath.Join(root, rel), []byte(strings.Join(dirs, "\n")+"\n"))
}

// updateCache sets entries in the container's loader cache, creating it
// when the image has none.
func updateCache(root string, entries []ldcache.Entry) error {
	rel, err := inroot.ResolveParent(root, cacheFile)
	if inroot.Absent(err) {
		return nil // no /etc: an image without a glibc loader (scratch, static)
	}
	if err != nil {
		return fmt.Errorf("%s in the container: %w", cacheFile, err)
	}
	p := filepath.Join(root, rel)
	cache := &ldcache.Cache{}
	data, err := os.ReadFile(p)
	switch {
	case err == nil:
		if cache, err = ldcache.Parse(data); err != nil {
			return fmt.Errorf("%s in the container: %w", cacheFile, err)
		}
	case errors.Is(err, os.ErrNotExist):
	default:
		return fmt.Errorf("read %s in the container: %w", cacheFile, err)
	}
	cache.Set(entries...)
	return writeAtomic(p, cache.Marshal())
}

// flagsOf are the loader cache flags of the library at p: those of its ELF
// machine, or of this program's architecture when p is no ELF file (the
// hook runs on the node, whose architecture the driver's is).
func flagsOf(p string) int32 {
	machine := map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64}[runtime.GOARCH]
	if f, err := elf.Open(p); err == nil {
		machine = f.Machine
		_ = f.Close()
	}
	if machine == elf.EM_AARCH64 {
		return ldcache.FlagAArch64
	}
	return ldcache.FlagX8664Lib64
}

// writeAtomic replaces p with data through a file beside it.
func writeAtomic(p string, data []byte) error {
	tmp, err := os.CreateTemp(filepath.Dir(p), "."+filepath.Base(p)+".tessera-*")
	if err != nil {
		return fmt.Errorf("write %s: %w", p, err)
	}
	defer func() { _ = os.Remove(tmp.Name()) }()
	if _, err := tmp.Write(data); err != nil {
		_ = tmp.Close()
		return fmt.Errorf("write %s: %w", p, err)
	}
	if err := tmp.Chmod(0o644); err != nil {
		_ = tmp.Close()
		return fmt.Errorf("write %s: %w", p, err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("write %s: %w", p, err)
	}
	if err := os.Rename(tmp.Name(), p); err != nil {
		return fmt.Errorf("write %s: %w", p, err)
	}
	return nil
}
