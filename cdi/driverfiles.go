package cdi

import (
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
)

// Where FindDriverFiles looks, relative to the driver root.
var (
	driverLibDirs = []string{
		"usr/lib/x86_64-linux-gnu",
		"usr/lib64",
		"lib64",
		"usr/lib",
		"lib/x86_64-linux-gnu",
		"usr/lib/aarch64-linux-gnu",
		"lib/aarch64-linux-gnu",
	}
	// driverLibs are file name patterns (path.Match) of the user-space
	// driver libraries a CUDA container needs.
	driverLibs = []string{
		"libnvidia-ml.so.1",
		"libcuda.so.1",
		"libcudadebugger.so.1",
		"libnvidia-ptxjitcompiler.so.1",
		"libnvidia-nvvm.so.4",
		"libnvidia-opencl.so.1",
		"libnvidia-gpucomp.so.*",
		"libnvidia-allocator.so.1",
		"libnvidia-cfg.so.1",
	}
	driverToolDirs = []string{"usr/bin", "bin"}
	driverTools    = []string{
		"nvidia-smi",
		"nvidia-debugdump",
		"nvidia-persistenced",
		"nvidia-cuda-mps-control",
		"nvidia-cuda-mps-server",
	}
	firmwareDirs = []string{"lib/firmware/nvidia", "usr/lib/firmware/nvidia"}
)

const (
	nvmlLib = "libnvidia-ml.so.1"
	// maxLinks bounds symlink resolution, as the kernel does (ELOOP).
	maxLinks = 40
)

// FindDriverFiles finds the NVIDIA user-space driver under driverRoot (the
// host's / or where a driver container installs it, e.g. /run/nvidia/driver)
// and returns one read-only bind mount per file: the libraries, the tools and
// the firmware directory of the driver version. HostPath is driverRoot+path,
// ContainerPath is path. Symlinks are followed inside driverRoot (absolute
// targets count from driverRoot) and every link on the way is mounted as well
// as the file it resolves to, since programs open the .so.1 names. Library
// directories that are links to one another (merged /usr) are searched once.
// Mounts are sorted by ContainerPath. It fails when libnvidia-ml.so.1 is
// missing, or when a file found is a dangling link.
func FindDriverFiles(driverRoot string) (Edits, error) {
	root, err := filepath.Abs(driverRoot)
	if err != nil {
		return Edits{}, fmt.Errorf("driver root %q: %w", driverRoot, err)
	}
	f := &finder{root: root, found: map[string]bool{}}
	nvml, err := f.addAll(driverLibDirs, driverLibs)
	if err != nil {
		return Edits{}, err
	}
	if nvml == "" {
		return Edits{}, fmt.Errorf("driver root %s: %s not found in any of %s; set --driver-root to where the NVIDIA driver is installed (/ for a host install, /run/nvidia/driver for the driver container)",
			root, nvmlLib, strings.Join(driverLibDirs, ", "))
	}
	if _, err := f.addAll(driverToolDirs, driverTools); err != nil {
		return Edits{}, err
	}
	if err := f.addFirmware(nvml); err != nil {
		return Edits{}, err
	}

	var edits Edits
	for _, rel := range slices.Sorted(maps.Keys(f.found)) {
		edits.Mounts = append(edits.Mounts, Mount{HostPath: filepath.Join(root, rel), ContainerPath: "/" + rel})
	}
	return edits, nil
}

// finder collects driver files as clean paths relative to root.
type finder struct {
	root  string
	found map[string]bool
}

// addAll adds the files matching patterns in each of dirs, and returns the
// file libnvidia-ml.so.1 first resolves to ("" if none was found).
func (f *finder) addAll(dirs, patterns []string) (nvml string, err error) {
	searched := map[string]bool{}
	for _, d := range dirs {
		dir, err := resolveIn(f.root, d)
		if absent(err) {
			continue
		}
		if err != nil {
			return "", fmt.Errorf("driver root %s: %s: %w", f.root, d, err)
		}
		if searched[dir] {
			continue
		}
		searched[dir] = true
		entries, err := os.ReadDir(filepath.Join(f.root, dir))
		if err != nil {
			return "", fmt.Errorf("driver root %s: %w", f.root, err)
		}
		for _, e := range entries {
			if !matchAny(patterns, e.Name()) {
				continue
			}
			target, err := f.addChain(path.Join(dir, e.Name()))
			if err != nil {
				return "", fmt.Errorf("driver root %s: %w; fix or reinstall the driver", f.root, err)
			}
			if e.Name() == nvmlLib && nvml == "" {
				nvml = target
			}
		}
	}
	return nvml, nil
}

// addChain adds rel (whose directory is already resolved), every link it
// leads through, and the regular file it ends at, which it returns.
func (f *finder) addChain(rel string) (string, error) {
	start := rel
	for range maxLinks {
		fi, err := os.Lstat(filepath.Join(f.root, rel))
		if err != nil {
			return "", fmt.Errorf("/%s (link target of /%s): %w", rel, start, err)
		}
		switch {
		case fi.Mode().IsRegular():
			f.found[rel] = true
			return rel, nil
		case fi.Mode()&fs.ModeSymlink == 0:
			return "", fmt.Errorf("/%s: not a regular file or symlink", rel)
		}
		f.found[rel] = true
		target, err := os.Readlink(filepath.Join(f.root, rel))
		if err != nil {
			return "", err
		}
		next := target
		if !path.IsAbs(target) {
			next = path.Dir(rel) + "/" + target
		}
		i := strings.LastIndexByte(next, '/')
		base := next[i+1:]
		if base == "" || base == "." || base == ".." {
			return "", fmt.Errorf("/%s: unsupported link target %q", rel, target)
		}
		dir, err := resolveIn(f.root, next[:i])
		if err != nil {
			return "", fmt.Errorf("/%s -> %s: %w", rel, target, err)
		}
		rel = path.Join(dir, base)
	}
	return "", fmt.Errorf("/%s: more than %d symlinks", start, maxLinks)
}

// addFirmware adds the firmware directory of the driver version, taken from
// the name of the file libnvidia-ml.so.1 resolves to (libnvidia-ml.so.<v>).
func (f *finder) addFirmware(nvml string) error {
	version := strings.TrimPrefix(path.Base(nvml), "libnvidia-ml.so.")
	if version == "1" || version == path.Base(nvml) {
		return nil // not versioned: nothing to look for
	}
	for _, d := range firmwareDirs {
		dir, err := resolveIn(f.root, path.Join(d, version))
		if absent(err) {
			continue
		}
		if err != nil {
			return fmt.Errorf("driver root %s: %s: %w", f.root, d, err)
		}
		if fi, err := os.Stat(filepath.Join(f.root, dir)); err == nil && fi.IsDir() {
			f.found[dir] = true
		}
	}
	return nil
}

// absent reports whether err says a path does not exist (possibly because a
// component of it is a file).
func absent(err error) bool {
	return errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR)
}

// resolveIn resolves rel inside root as if root were "/": symlinks are
// followed, absolute link targets start at root, and ".." stops at root. It
// returns the resolved path relative to root, clean and without a leading
// slash ("" for root itself). Every component must exist.
func resolveIn(root, rel string) (string, error) {
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
		if links++; links > maxLinks {
			return "", fmt.Errorf("/%s: more than %d symlinks", cur, maxLinks)
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

func matchAny(patterns []string, name string) bool {
	for _, p := range patterns {
		if ok, _ := path.Match(p, name); ok {
			return true
		}
	}
	return false
}
