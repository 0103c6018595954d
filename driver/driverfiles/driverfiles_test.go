package driverfiles_test

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"k8s.io/klog/v2"
	"k8s.io/klog/v2/ktesting"

	"github.com/tessera-dev/tessera/cdi"
	"github.com/tessera-dev/tessera/driver/driverfiles"
	"github.com/tessera-dev/tessera/driver/fakenode"
)

const (
	version = "570.124.06"
	hook    = "/var/lib/kubelet/plugins/gpu.tessera.dev/bin/tessera-cdi-hook"
)

// The files each group of NVIDIA's container toolkit documentation names,
// as a driver installs them (fakenode.InstallDriver), written out here.
var (
	utilityLibs = []string{"libnvidia-ml.so.1", "libnvidia-ml.so." + version, "libnvidia-cfg.so.1", "libnvidia-cfg.so." + version}
	computeLibs = []string{
		"libcuda.so.1", "libcuda.so." + version,
		"libcudadebugger.so.1", "libcudadebugger.so." + version,
		"libnvidia-ptxjitcompiler.so.1", "libnvidia-ptxjitcompiler.so." + version,
		"libnvidia-nvvm.so.4", "libnvidia-nvvm.so." + version,
		"libnvidia-gpucomp.so." + version,
		"libnvidia-allocator.so.1", "libnvidia-allocator.so." + version,
		"libnvidia-opencl.so.1", "libnvidia-opencl.so." + version,
		"libnvidia-pkcs11-openssl3.so." + version,
	}
	videoLibs    = []string{"libnvcuvid.so.1", "libnvcuvid.so." + version, "libnvidia-encode.so.1", "libnvidia-encode.so." + version, "libnvidia-opticalflow.so.1", "libnvidia-opticalflow.so." + version}
	graphicsLibs = []string{
		"libnvidia-eglcore.so." + version, "libnvidia-glcore.so." + version, "libnvidia-tls.so." + version, "libnvidia-glsi.so." + version,
		"libGLX_nvidia.so.0", "libGLX_nvidia.so." + version, "libEGL_nvidia.so.0", "libEGL_nvidia.so." + version,
	}
	// Tools, firmware and socket, for every container.
	always = []string{
		"/lib/firmware/nvidia/" + version,
		"/run/nvidia-persistenced/socket",
		"/usr/bin/nvidia-cuda-mps-control",
		"/usr/bin/nvidia-cuda-mps-server",
		"/usr/bin/nvidia-debugdump",
		"/usr/bin/nvidia-persistenced",
		"/usr/bin/nvidia-smi",
	}
)

func in(dir string, names ...[]string) []string {
	var out []string
	for _, n := range names {
		for _, name := range n {
			out = append(out, "/"+dir+"/"+name)
		}
	}
	return out
}

func containerPaths(e cdi.Edits) []string {
	var out []string
	for _, m := range e.Mounts {
		out = append(out, m.ContainerPath)
	}
	return out
}

func sorted(s []string) []string {
	s = slices.Clone(s)
	slices.Sort(s)
	return s
}

func find(t *testing.T, opts driverfiles.Options) *driverfiles.Files {
	t.Helper()
	_, ctx := ktesting.NewTestContext(t)
	f, err := driverfiles.Find(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// TestEachLayoutGetsTheToolkitsFiles: for the glibc layouts (Debian x86_64
// and aarch64 as on Grace, Red Hat lib64) a container gets the utility and
// compute files always, the video libraries for the engines its devices
// have, the graphics libraries when asked; every mount names the host's
// path; the hook links libcuda.so and libnvidia-ml.so and puts every soname
// in the loader cache.
func TestEachLayoutGetsTheToolkitsFiles(t *testing.T) {
	for _, libDir := range []string{"usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "usr/lib64"} {
		t.Run(libDir, func(t *testing.T) {
			root := t.TempDir()
			if err := fakenode.InstallDriver(root, libDir, version); err != nil {
				t.Fatal(err)
			}
			f := find(t, driverfiles.Options{Root: root, HostRoot: "/host/driver", Version: version, Hook: hook})
			for _, tt := range []struct {
				name string
				need driverfiles.Need
				want []string
			}{
				{"compute only", driverfiles.Need{}, append(in(libDir, utilityLibs, computeLibs), always...)},
				{"with every video engine", driverfiles.Need{Decoders: true, Encoders: true, OpticalFlow: true}, append(in(libDir, utilityLibs, computeLibs, videoLibs), always...)},
				{"decoders only", driverfiles.Need{Decoders: true}, append(in(libDir, utilityLibs, computeLibs, videoLibs[:2]), always...)},
				{"graphics", driverfiles.Need{Graphics: true}, append(in(libDir, utilityLibs, computeLibs, graphicsLibs), always...)},
			} {
				t.Run(tt.name, func(t *testing.T) {
					got, err := f.Edits(tt.need)
					if err != nil {
						t.Fatal(err)
					}
					if diff := cmp.Diff(sorted(tt.want), containerPaths(got)); diff != "" {
						t.Errorf("mounts (-want +got):\n%s", diff)
					}
					for _, m := range got.Mounts {
						if m.HostPath != "/host/driver"+m.ContainerPath {
							t.Errorf("mount %s: host path %s, want it under the host's driver root", m.ContainerPath, m.HostPath)
						}
					}
					if len(got.Hooks) != 1 {
						t.Fatalf("hooks %+v, want one", got.Hooks)
					}
					h := got.Hooks[0]
					if h.Name != cdi.CreateContainer || h.Path != hook || !slices.Equal(h.Args[:2], []string{"tessera-cdi-hook", "update-ldcache"}) {
						t.Errorf("hook %+v", h)
					}
					if h.Timeout != driverfiles.HookTimeout || h.Timeout <= 0 {
						t.Errorf("hook timeout %d s, want %d: a hook without one that blocks holds the runtime", h.Timeout, driverfiles.HookTimeout)
					}
					d := "/" + libDir + "/"
					for _, arg := range []string{"--link=" + d + "libcuda.so=libcuda.so.1", "--link=" + d + "libnvidia-ml.so=libnvidia-ml.so.1",
						"--library=" + d + "libcuda.so.1", "--library=" + d + "libcuda.so", "--library=" + d + "libnvidia-ml.so.1",
						"--library=" + d + "libnvidia-gpucomp.so." + version, "--library=" + d + "libnvidia-nvvm.so.4"} {
						if !slices.Contains(h.Args, arg) {
							t.Errorf("hook arguments %q lack %q", h.Args, arg)
						}
					}
					if video := slices.Contains(h.Args, "--library="+d+"libnvcuvid.so.1"); video != tt.need.Decoders {
						t.Errorf("libnvcuvid.so.1 in the loader cache: %v, want %v", video, tt.need.Decoders)
					}
				})
			}
		})
	}
}

func TestTheHookMakesTheSonameLinkADriverLacks(t *testing.T) {
	root := t.TempDir()
	dir := "usr/lib64"
	if err := fakenode.InstallDriver(root, dir, version); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(root, dir, "libcuda.so.1")); err != nil {
		t.Fatal(err)
	}
	got, err := find(t, driverfiles.Options{Root: root, Version: version, Hook: hook}).Edits(driverfiles.Need{})
	if err != nil {
		t.Fatal(err)
	}
	paths := containerPaths(got)
	if slices.Contains(paths, "/usr/lib64/libcuda.so.1") || !slices.Contains(paths, "/usr/lib64/libcuda.so."+version) {
		t.Errorf("mounts %v: want libcuda.so.%s and no libcuda.so.1", paths, version)
	}
	for _, arg := range []string{"--link=/usr/lib64/libcuda.so.1=libcuda.so." + version, "--library=/usr/lib64/libcuda.so.1"} {
		if !slices.Contains(got.Hooks[0].Args, arg) {
			t.Errorf("hook arguments %q lack %q", got.Hooks[0].Args, arg)
		}
	}
}

func TestWithoutAHookPathTheSpecsHaveNoHook(t *testing.T) {
	root := t.TempDir()
	if err := fakenode.InstallDriver(root, "usr/lib64", version); err != nil {
		t.Fatal(err)
	}
	got, err := find(t, driverfiles.Options{Root: root}).Edits(driverfiles.Need{})
	if err != nil {
		t.Fatal(err)
	}
	if len(got.Hooks) != 0 || len(got.Mounts) == 0 {
		t.Errorf("edits %+v: want mounts and no hook", got)
	}
}

// TestTheVersionComesFromLibnvidiaML: without a version from NVML, the one
// libnvidia-ml.so.1 links to is looked for.
func TestTheVersionComesFromLibnvidiaML(t *testing.T) {
	root := t.TempDir()
	if err := fakenode.InstallDriver(root, "usr/lib/x86_64-linux-gnu", version); err != nil {
		t.Fatal(err)
	}
	f := find(t, driverfiles.Options{Root: root})
	if f.Version != version {
		t.Errorf("version %q, want %q", f.Version, version)
	}
}

func TestLinksAreFollowedInsideTheDriverRoot(t *testing.T) {
	root := t.TempDir()
	if err := fakenode.InstallDriver(root, "usr/lib64", version); err != nil {
		t.Fatal(err)
	}
	// Merged /usr: lib64 is usr/lib64, searched once.
	if err := os.Symlink("usr/lib64", filepath.Join(root, "lib64")); err != nil {
		t.Fatal(err)
	}
	// An absolute link target counts from the driver root, not the host's /.
	nvml := filepath.Join(root, "usr/lib64/libnvidia-ml.so.1")
	if err := os.Remove(nvml); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/usr/lib64/nvidia/libnvidia-ml.so.1", nvml); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(root, "usr/lib64/nvidia"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("../libnvidia-ml.so."+version, filepath.Join(root, "usr/lib64/nvidia/libnvidia-ml.so.1")); err != nil {
		t.Fatal(err)
	}
	got, err := find(t, driverfiles.Options{Root: root, Version: version}).Edits(driverfiles.Need{})
	if err != nil {
		t.Fatal(err)
	}
	paths := containerPaths(got)
	for _, p := range []string{"/usr/lib64/libnvidia-ml.so.1", "/usr/lib64/nvidia/libnvidia-ml.so.1", "/usr/lib64/libnvidia-ml.so." + version} {
		if !slices.Contains(paths, p) {
			t.Errorf("mounts %v lack %s", paths, p)
		}
	}
	for _, p := range paths {
		if strings.HasPrefix(p, "/lib64/") {
			t.Errorf("mount %s: lib64 is usr/lib64 and must be searched once", p)
		}
	}
}

// TestAMissingRequiredLibraryFailsEveryPrepare: the plugin starts, and
// every claim's edits fail naming the driver root and the flag to fix.
func TestAMissingRequiredLibraryFailsEveryPrepare(t *testing.T) {
	root := t.TempDir()
	if err := fakenode.InstallDriver(root, "usr/lib64", version); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"libcuda.so.1", "libcuda.so." + version} {
		if err := os.Remove(filepath.Join(root, "usr/lib64", name)); err != nil {
			t.Fatal(err)
		}
	}
	f := find(t, driverfiles.Options{Root: root, Version: version})
	for range 2 {
		_, err := f.Edits(driverfiles.Need{})
		if err == nil {
			t.Fatal("no error")
		}
		for _, want := range []string{"driver root " + root, "libcuda.so." + version + " or libcuda.so.1 not found", "--driver-root", "kubeletPlugin.driverRoot"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("error %q lacks %q", err, want)
			}
		}
	}
	// An empty root: no libnvidia-ml either.
	_, err := find(t, driverfiles.Options{Root: t.TempDir()}).Edits(driverfiles.Need{})
	if err == nil || !strings.Contains(err.Error(), "libnvidia-ml.so.1 not found") {
		t.Errorf("empty driver root: %v", err)
	}
}

// TestAMissingOptionalFileIsLoggedOnce: Find logs it, in one line; Edits,
// called for every prepare, does not.
func TestAMissingOptionalFileIsLoggedOnce(t *testing.T) {
	root := t.TempDir()
	if err := fakenode.InstallDriver(root, "usr/lib64", version); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(root, "usr/bin/nvidia-debugdump")); err != nil {
		t.Fatal(err)
	}
	logger := ktesting.NewLogger(t, ktesting.NewConfig(ktesting.BufferLogs(true)))
	ctx := klog.NewContext(context.Background(), logger)
	f, err := driverfiles.Find(ctx, driverfiles.Options{Root: root, Version: version})
	if err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if _, err := f.Edits(driverfiles.Need{Decoders: true}); err != nil {
			t.Fatal(err)
		}
	}
	logs := logger.GetSink().(ktesting.Underlier).GetBuffer().String()
	if n := strings.Count(logs, "nvidia-debugdump"); n != 1 {
		t.Errorf("nvidia-debugdump named %d times in the log, want once:\n%s", n, logs)
	}
}

func TestARootThatIsNoDirectoryFailsFind(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	_, err := driverfiles.Find(ctx, driverfiles.Options{Root: filepath.Join(t.TempDir(), "absent")})
	if err == nil || !strings.Contains(err.Error(), "--driver-root") {
		t.Errorf("got %v", err)
	}
}
