package fakenode

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
)

// A fake node's user-space driver is laid out as NVIDIA's packages install
// it (the .run installer and the distribution packages agree on this):
// every library as <name>.so.<driver version>, with a soname link where the
// library has a soname of its own; the tools in usr/bin (every fake node
// has the IMEX service's nvidia-imex and nvidia-imex-ctl too; nvidia-imex
// links to IMEXStandIn); the GSP firmware in
// lib/firmware/nvidia/<version>; the persistence daemon's socket (a regular
// file stands in, as for device nodes). The list is written out here, apart
// from driver/driverfiles, so that tests of discovery check it against an
// install they did not derive from it.
var fakeLibraries = []struct{ name, soname string }{
	{"libnvidia-ml.so", "libnvidia-ml.so.1"},
	{"libnvidia-cfg.so", "libnvidia-cfg.so.1"},
	{"libcuda.so", "libcuda.so.1"},
	{"libcudadebugger.so", "libcudadebugger.so.1"},
	{"libnvidia-ptxjitcompiler.so", "libnvidia-ptxjitcompiler.so.1"},
	{"libnvidia-nvvm.so", "libnvidia-nvvm.so.4"},
	{"libnvidia-gpucomp.so", ""},
	{"libnvidia-allocator.so", "libnvidia-allocator.so.1"},
	{"libnvidia-opencl.so", "libnvidia-opencl.so.1"},
	{"libnvidia-pkcs11-openssl3.so", ""},
	{"libnvcuvid.so", "libnvcuvid.so.1"},
	{"libnvidia-encode.so", "libnvidia-encode.so.1"},
	{"libnvidia-opticalflow.so", "libnvidia-opticalflow.so.1"},
	{"libnvidia-eglcore.so", ""},
	{"libnvidia-glcore.so", ""},
	{"libnvidia-tls.so", ""},
	{"libnvidia-glsi.so", ""},
	{"libGLX_nvidia.so", "libGLX_nvidia.so.0"},
	{"libEGL_nvidia.so", "libEGL_nvidia.so.0"},
}

var fakeTools = []string{"nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server", "nvidia-imex-ctl"}

// IMEXStandIn is where a fake driver's usr/bin/nvidia-imex points: the
// stand-in for NVIDIA's IMEX daemon (driver/fakenode/imexd) in Tessera's
// image. The link is absolute on purpose: the plugin runs the daemon in a
// pod from Tessera's image with the host's driver root mounted, and there
// the link resolves to the image's binary. On the host it dangles, which
// is harmless: the plugin never runs a driver root's binaries on the host,
// and discovery mounts no nvidia-imex into containers (nor does NVIDIA's
// toolkit).
const IMEXStandIn = "/usr/local/bin/tessera-fake-imex"

// FakeLibraries lists the file names InstallDriver puts in the library
// directory for a driver version: every versioned file and soname link.
func FakeLibraries(version string) []string {
	var out []string
	for _, l := range fakeLibraries {
		out = append(out, l.name+"."+version)
		if l.soname != "" {
			out = append(out, l.soname)
		}
	}
	return out
}

// InstallDriver lays out a driver of the given version under root, its
// libraries in libDir (relative to root, e.g. usr/lib/x86_64-linux-gnu or
// usr/lib/aarch64-linux-gnu on Grace). It may be called again on an
// existing tree.
func InstallDriver(root, libDir, version string) error {
	dir := filepath.Join(root, libDir)
	for _, l := range fakeLibraries {
		real := l.name + "." + version
		if err := mkfile(filepath.Join(dir, real), "fake "+real+"\n", 0o644); err != nil {
			return err
		}
		if l.soname == "" {
			continue
		}
		_ = os.Remove(filepath.Join(dir, l.soname))
		if err := os.Symlink(real, filepath.Join(dir, l.soname)); err != nil {
			return err
		}
	}
	for _, t := range fakeTools {
		content := "#!/bin/false\n"
		if t == "nvidia-cuda-mps-control" {
			content = string(fakeDaemon())
		}
		if err := mkfile(filepath.Join(root, "usr", "bin", t), content, 0o755); err != nil {
			return err
		}
	}
	imex := filepath.Join(root, "usr", "bin", "nvidia-imex")
	if err := os.Remove(imex); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	if err := os.Symlink(IMEXStandIn, imex); err != nil {
		return err
	}
	for _, fw := range []string{"gsp_ga10x.bin", "gsp_tu10x.bin"} {
		if err := mkfile(filepath.Join(root, "lib", "firmware", "nvidia", version, fw), "fake firmware\n", 0o644); err != nil {
			return err
		}
	}
	if err := mkfile(filepath.Join(root, "run", "nvidia-persistenced", "socket"), "", 0o666); err != nil {
		return fmt.Errorf("persistenced socket: %w", err)
	}
	return nil
}
