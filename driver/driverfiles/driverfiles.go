// Package driverfiles finds the NVIDIA driver's user-space files under a
// driver root, as NVIDIA's container toolkit documents them (libraries by
// name and driver version, tools, GSP firmware, IPC sockets), and says which
// of them, with the CDI hook that makes them loadable, a claim's containers
// get for what its devices can do.
package driverfiles

import (
	"context"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"

	"k8s.io/klog/v2"

	"github.com/tessera-dev/tessera/cdi"
	"github.com/tessera-dev/tessera/driver/inroot"
)

// Options say where to look and how the containers reach what is found.
type Options struct {
	// Root is the driver root as this process sees it: / for a driver
	// installed on the host, the driver container's root (e.g.
	// /run/nvidia/driver), or where the host's root is mounted.
	Root string
	// HostRoot is the same directory as the container runtime on the host
	// sees it, which CDI specs name; empty means Root.
	HostRoot string
	// Version is the driver version NVML reports (565.57.01); empty takes it
	// from the file libnvidia-ml.so.1 links to.
	Version string
	// Hook is the host path of tessera-cdi-hook (cmd/tessera-cdi-hook);
	// empty leaves the hook out of the specs, and containers whose image
	// loads libraries from another directory than the driver's cannot find
	// them.
	Hook string
}

// Need is what a claim's devices can do and what the claim asks for.
type Need struct {
	// Decoders, Encoders and OpticalFlow: some device has NVDEC, NVENC or
	// OFA engines (a whole GPU has all its board has; a MIG device those of
	// its profile).
	Decoders, Encoders, OpticalFlow bool
	// Graphics: the claim asks for OpenGL, EGL and Vulkan.
	Graphics bool
}

// Files are the driver files found under a driver root.
type Files struct {
	opts Options
	// Version is the driver version the libraries were looked up by.
	Version string
	found   [groups]groupFiles
	// missing are the required libraries not found, with why.
	missing []string
}

// groupFiles is what one group found.
type groupFiles struct {
	// paths are relative to the root, every link on the way included.
	paths []string
	// libraries are the container paths of the names the loader cache
	// gets (sonames and dev links).
	libraries []string
	// links are the symlinks the hook creates: container path -> target.
	links map[string]string
}

// Find looks for the driver's files under opts.Root. A missing optional
// file (one not every driver install has) is logged once, here; a missing
// required library is reported by Edits, so that the plugin starts and every
// prepare says what is wrong. It fails only when the root itself cannot be
// read.
func Find(ctx context.Context, opts Options) (*Files, error) {
	logger := klog.FromContext(ctx)
	root, err := filepath.Abs(opts.Root)
	if err != nil {
		return nil, fmt.Errorf("driver root %q: %w", opts.Root, err)
	}
	if fi, err := os.Stat(root); err != nil || !fi.IsDir() {
		return nil, fmt.Errorf("driver root %s is not a readable directory (%v); set --driver-root to where the NVIDIA driver is installed", root, err)
	}
	opts.Root = root
	if opts.HostRoot == "" {
		opts.HostRoot = root
	}
	f := &Files{opts: opts, Version: opts.Version}
	dirs := resolveDirs(root, LibDirs)
	if f.Version == "" {
		f.Version = versionOf(root, dirs)
	}
	var absent []string
	for _, lib := range libraries {
		ok, names := f.addLibrary(dirs, lib)
		switch {
		case ok:
		case lib.required:
			f.missing = append(f.missing, fmt.Sprintf("%s not found in any of %s", names, strings.Join(LibDirs, ", ")))
		default:
			absent = append(absent, names)
		}
	}
	for _, b := range binaries {
		if !f.addFile(resolveDirs(root, binDirs), b.name, b.group) {
			absent = append(absent, b.name)
		}
	}
	for _, s := range sockets {
		if !f.addFile(resolveDirs(root, s.dirs), s.name, s.group) {
			absent = append(absent, "/"+s.dirs[0]+"/"+s.name)
		}
	}
	if !f.addFirmware() {
		absent = append(absent, "GSP firmware lib/firmware/nvidia/"+f.Version)
	}
	if len(absent) > 0 {
		logger.Info("Optional NVIDIA driver files not found; containers get the driver without them", "driverRoot", root, "missing", absent)
	}
	if len(f.missing) > 0 {
		logger.Error(nil, "Required NVIDIA driver libraries not found; every prepare will fail until the driver root is fixed", "driverRoot", root, "missing", f.missing)
	}
	return f, nil
}

// Edits are the mounts and hook a claim's containers get for need: the
// utility and compute files always, the video libraries for the engines its
// devices have, the graphics libraries when it asks. They fail when a
// required library is missing, naming the driver root.
func (f *Files) Edits(need Need) (cdi.Edits, error) {
	if len(f.missing) > 0 {
		return cdi.Edits{}, fmt.Errorf("driver root %s: %s; set --driver-root (chart value kubeletPlugin.driverRoot) to where the NVIDIA driver is installed: / for a driver installed on the host, /run/nvidia/driver for the GPU operator's driver container",
			f.opts.Root, strings.Join(f.missing, "; "))
	}
	want := []group{utility, compute}
	for _, g := range []struct {
		on bool
		g  group
	}{{need.Decoders, decode}, {need.Encoders, encode}, {need.OpticalFlow, opticalFlow}, {need.Graphics, graphics}} {
		if g.on {
			want = append(want, g.g)
		}
	}
	paths := map[string]bool{}
	links := map[string]string{}
	var libs []string
	for _, g := range want {
		for _, p := range f.found[g].paths {
			paths[p] = true
		}
		maps.Copy(links, f.found[g].links)
		libs = append(libs, f.found[g].libraries...)
	}
	var edits cdi.Edits
	for _, p := range slices.Sorted(maps.Keys(paths)) {
		edits.Mounts = append(edits.Mounts, cdi.Mount{HostPath: filepath.Join(f.opts.HostRoot, p), ContainerPath: "/" + p})
	}
	if f.opts.Hook != "" && len(libs) > 0 {
		edits.Hooks = []cdi.Hook{HookFor(f.opts.Hook, libs, links)}
	}
	return edits, nil
}

// HookFor is the createContainer hook that creates links (container path
// -> target) and adds libraries (container paths) to the container's loader
// cache: tessera-cdi-hook's command line (cmd/tessera-cdi-hook).
func HookFor(hookPath string, libraries []string, links map[string]string) cdi.Hook {
	args := []string{"tessera-cdi-hook", "update-ldcache"}
	for _, l := range slices.Sorted(maps.Keys(links)) {
		args = append(args, "--link="+l+"="+links[l])
	}
	libraries = slices.Clone(libraries)
	slices.Sort(libraries)
	for _, l := range slices.Compact(libraries) {
		args = append(args, "--library="+l)
	}
	return cdi.Hook{Name: cdi.CreateContainer, Path: hookPath, Args: args, Timeout: HookTimeout}
}

// HookTimeout is the seconds the runtime gives tessera-cdi-hook (the CDI
// spec's hook timeout): it reads a few small files, none that can block, so
// a hook still running then is stuck, and is better killed (the container's
// creation fails and the kubelet retries) than left holding the runtime.
const HookTimeout = 10

// Missing lists the required libraries not found, with why; empty when the
// driver root is usable.
func (f *Files) Missing() []string { return slices.Clone(f.missing) }

// addLibrary finds lib in the first of dirs (resolved, relative to the root)
// that has it: the versioned file, and the soname link where the driver
// made one. Without a soname link, the hook makes it in the container. It
// returns false and the names looked for when the library is not usable.
func (f *Files) addLibrary(dirs []string, lib library) (bool, string) {
	versioned := lib.name + "." + f.Version
	for _, dir := range dirs {
		var file string
		if f.Version != "" {
			file = f.chain(path.Join(dir, versioned))
		}
		var soname string
		if lib.soname != "" {
			soname = f.chain(path.Join(dir, lib.soname))
		}
		if file == "" && soname == "" {
			continue
		}
		g := &f.found[lib.group]
		if g.links == nil {
			g.links = map[string]string{}
		}
		add := func(rel string) { g.paths = append(g.paths, f.paths(rel)...) }
		target := versioned // what the links the hook makes point at
		switch {
		case file != "" && soname == "":
			add(path.Join(dir, versioned))
			if lib.soname != "" {
				g.links["/"+path.Join(dir, lib.soname)] = versioned
			}
		case file == "" && soname != "":
			// An install without the driver version in its names (or
			// another version than NVML's): the soname is what there is.
			add(path.Join(dir, lib.soname))
			target = lib.soname
		default:
			add(path.Join(dir, versioned))
			add(path.Join(dir, lib.soname))
		}
		name := lib.soname
		if name == "" {
			name = versioned
		}
		g.libraries = append(g.libraries, "/"+path.Join(dir, name))
		if lib.devLink {
			dev := "/" + path.Join(dir, lib.name)
			g.links[dev] = cmpOr(lib.soname, target)
			g.libraries = append(g.libraries, dev)
		}
		return true, ""
	}
	switch {
	case f.Version == "":
		return false, cmpOr(lib.soname, lib.name+".<version>")
	case lib.soname == "":
		return false, versioned
	}
	return false, versioned + " or " + lib.soname
}

// addFile adds name from the first of dirs that has it.
func (f *Files) addFile(dirs []string, name string, g group) bool {
	for _, dir := range dirs {
		rel := path.Join(dir, name)
		if f.chain(rel) != "" {
			f.found[g].paths = append(f.found[g].paths, f.paths(rel)...)
			return true
		}
	}
	return false
}

// addFirmware adds the GSP firmware directory of the driver version, for
// every container (the toolkit mounts it with the utility files).
func (f *Files) addFirmware() bool {
	if f.Version == "" {
		return false
	}
	for _, d := range firmwareDirs {
		dir, err := inroot.Resolve(f.opts.Root, path.Join(d, f.Version))
		if err != nil {
			continue
		}
		if fi, err := os.Stat(filepath.Join(f.opts.Root, dir)); err == nil && fi.IsDir() {
			f.found[utility].paths = append(f.found[utility].paths, dir)
			return true
		}
	}
	return false
}

// chain returns what rel (whose directory is resolved) ends at after its
// links, or "" when it does not exist, dangles or is a directory.
func (f *Files) chain(rel string) string {
	p := f.paths(rel)
	if len(p) == 0 {
		return ""
	}
	return p[len(p)-1]
}

// paths lists rel, every link it leads through and the file it ends at;
// nil when it does not end at a file (regular, or a socket).
func (f *Files) paths(rel string) []string {
	var out []string
	for range inroot.MaxLinks {
		fi, err := os.Lstat(filepath.Join(f.opts.Root, rel))
		if err != nil {
			return nil
		}
		out = append(out, rel)
		switch {
		case fi.Mode().IsRegular(), fi.Mode()&fs.ModeSocket != 0:
			return out
		case fi.Mode()&fs.ModeSymlink == 0:
			return nil
		}
		target, err := os.Readlink(filepath.Join(f.opts.Root, rel))
		if err != nil {
			return nil
		}
		next := target
		if !path.IsAbs(target) {
			next = path.Dir(rel) + "/" + target
		}
		base := path.Base(next)
		if base == "." || base == ".." || base == "/" {
			return nil
		}
		dir, err := inroot.Resolve(f.opts.Root, path.Dir(next))
		if err != nil {
			return nil
		}
		rel = path.Join(dir, base)
	}
	return nil
}

// resolveDirs resolves dirs inside root, leaving out the missing ones and
// repeats (merged /usr: lib64 -> usr/lib64).
func resolveDirs(root string, dirs []string) []string {
	var out []string
	for _, d := range dirs {
		r, err := inroot.Resolve(root, d)
		if err != nil || slices.Contains(out, r) {
			continue
		}
		if fi, err := os.Stat(filepath.Join(root, r)); err != nil || !fi.IsDir() {
			continue
		}
		out = append(out, r)
	}
	return out
}

// versionOf reads the driver version off the file libnvidia-ml.so.1 links
// to (libnvidia-ml.so.<version>); "" when it is not versioned.
func versionOf(root string, dirs []string) string {
	f := &Files{opts: Options{Root: root}}
	for _, dir := range dirs {
		file := f.chain(path.Join(dir, "libnvidia-ml.so.1"))
		if file == "" {
			continue
		}
		if v, ok := strings.CutPrefix(path.Base(file), "libnvidia-ml.so."); ok && v != "1" {
			return v
		}
		return ""
	}
	return ""
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}
