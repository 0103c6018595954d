package cdi

import (
	"os"
	"path/filepath"
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

// driverEdits are driver mounts and a hook as driver/driverfiles makes
// them, written out here: this package only carries them.
func driverEdits(root string) Edits {
	var e Edits
	for _, p := range []string{
		"/lib/firmware/nvidia/" + driverVersion,
		"/usr/bin/nvidia-smi",
		"/usr/lib/x86_64-linux-gnu/libcuda.so.1",
		"/usr/lib/x86_64-linux-gnu/libcuda.so." + driverVersion,
		"/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
		"/usr/lib/x86_64-linux-gnu/libnvidia-ml.so." + driverVersion,
	} {
		e.Mounts = append(e.Mounts, Mount{HostPath: root + p, ContainerPath: p})
	}
	e.Hooks = []Hook{{Name: CreateContainer, Path: "/var/lib/kubelet/plugins/gpu.tessera.dev/bin/tessera-cdi-hook",
		Args: []string{"tessera-cdi-hook", "update-ldcache", "--library=/usr/lib/x86_64-linux-gnu/libcuda.so.1"}, Timeout: 10}}
	return e
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
			Hooks:  driver.Hooks,
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
