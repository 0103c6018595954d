package cdi

import (
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
)

const (
	uidA          = "0b6c0a57-8f0e-4f64-9b53-1f2e3d4c5b6a"
	uidB          = "7d9e2c11-3a4b-4c5d-8e6f-a1b2c3d4e5f6"
	driverVersion = "550.54.15"
)

// writeFile creates a regular file (and its parent dirs) under root.
func writeFile(t *testing.T, root, rel string) {
	t.Helper()
	p := filepath.Join(root, rel)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(rel), 0o644); err != nil {
		t.Fatal(err)
	}
}

// symlink creates root/rel -> target (parent dirs too).
func symlink(t *testing.T, root, rel, target string) {
	t.Helper()
	p := filepath.Join(root, rel)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, p); err != nil {
		t.Fatal(err)
	}
}

// installDriver mimics a driver install in libDir of root: versioned files,
// .so.1 links to them, a development link nobody mounts, an unrelated
// library, two tools and the GSP firmware directory.
func installDriver(t *testing.T, root, libDir string) {
	t.Helper()
	for _, lib := range []string{"libnvidia-ml", "libcuda", "libnvidia-ptxjitcompiler"} {
		writeFile(t, root, libDir+"/"+lib+".so."+driverVersion)
		symlink(t, root, libDir+"/"+lib+".so.1", lib+".so."+driverVersion)
	}
	symlink(t, root, libDir+"/libcuda.so", "libcuda.so.1")
	writeFile(t, root, libDir+"/libnvidia-gpucomp.so."+driverVersion)
	writeFile(t, root, libDir+"/libz.so.1")
	writeFile(t, root, "usr/bin/nvidia-smi")
	writeFile(t, root, "usr/bin/nvidia-cuda-mps-control")
	writeFile(t, root, "usr/bin/bash")
	writeFile(t, root, "lib/firmware/nvidia/"+driverVersion+"/gsp_ga10x.bin")
}

// installedMounts lists what FindDriverFiles must find for installDriver.
func installedMounts(root, libDir string) []Mount {
	paths := []string{
		"/" + libDir + "/libcuda.so.1",
		"/" + libDir + "/libcuda.so." + driverVersion,
		"/" + libDir + "/libnvidia-gpucomp.so." + driverVersion,
		"/" + libDir + "/libnvidia-ml.so.1",
		"/" + libDir + "/libnvidia-ml.so." + driverVersion,
		"/" + libDir + "/libnvidia-ptxjitcompiler.so.1",
		"/" + libDir + "/libnvidia-ptxjitcompiler.so." + driverVersion,
		"/lib/firmware/nvidia/" + driverVersion,
		"/usr/bin/nvidia-cuda-mps-control",
		"/usr/bin/nvidia-smi",
	}
	slices.Sort(paths) // FindDriverFiles sorts by container path
	var mounts []Mount
	for _, p := range paths {
		mounts = append(mounts, Mount{HostPath: root + p, ContainerPath: p})
	}
	return mounts
}

// fakeNode creates a regular file standing in for a device node under devRoot
// and returns the node.
func fakeNode(t *testing.T, devRoot, path string, major, minor int64) DeviceNode {
	t.Helper()
	writeFile(t, devRoot, path)
	return DeviceNode{Path: path, HostPath: filepath.Join(devRoot, path), Major: major, Minor: minor}
}

// gpuClaim is a claim of whole GPUs with the control nodes, claim env and
// driver mounts a real prepare would give it.
func gpuClaim(t *testing.T, uid, name, devRoot string, driver Edits, minors ...int64) ClaimSpec {
	t.Helper()
	c := ClaimSpec{
		ClaimUID:       uid,
		ClaimNamespace: "default",
		ClaimName:      name,
		Common: Edits{
			DeviceNodes: []DeviceNode{
				fakeNode(t, devRoot, "/dev/nvidiactl", 195, 255),
				fakeNode(t, devRoot, "/dev/nvidia-uvm", 508, 0),
				fakeNode(t, devRoot, "/dev/nvidia-uvm-tools", 508, 1),
			},
			Env:    []string{"NVIDIA_VISIBLE_DEVICES=GPU-" + name},
			Mounts: driver.Mounts,
		},
	}
	for _, m := range minors {
		n := fakeNode(t, devRoot, "/dev/nvidia"+itoa(m), 195, m)
		c.Devices = append(c.Devices, Device{
			Name:        "gpu-" + itoa(m),
			DeviceNodes: []DeviceNode{n},
			Env:         []string{"TESSERA_GPU_" + itoa(m) + "=" + name},
		})
	}
	return c
}

func itoa(i int64) string { return strconv.FormatInt(i, 10) }

func newStore(t *testing.T) *Store {
	t.Helper()
	s, err := NewStore(filepath.Join(t.TempDir(), "cdi"))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// dirNames lists the file names in dir.
func dirNames(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	return names
}
