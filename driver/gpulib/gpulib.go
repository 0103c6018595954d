// Package gpulib is Tessera's boundary to NVML: the small part of the NVML API the
// driver uses, and how a node's NVML and host file systems are opened. Everything
// above this package talks to a Node; whether NVML is the real library or a fake
// node's mock is decided here, once, by the caller's flags — never as a fallback.
package gpulib

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// Library is the part of NVML that Tessera calls at the system level. The real
// library (nvml.New) and go-nvml's mock servers both satisfy it; device-level
// calls go through go-nvml's own nvml.Device.
type Library interface {
	Init() nvml.Return
	Shutdown() nvml.Return
	SystemGetDriverVersion() (string, nvml.Return)
	SystemGetCudaDriverVersion() (int, nvml.Return)
	DeviceGetCount() (int, nvml.Return)
	DeviceGetHandleByIndex(index int) (nvml.Device, nvml.Return)
	DeviceGetHandleByUUID(uuid string) (nvml.Device, nvml.Return)
	// EventSetCreate opens a set that devices register their events (XIDs,
	// ECC errors) in; health monitoring waits on it.
	EventSetCreate() (nvml.EventSet, nvml.Return)
}

// Node is what Tessera reads on a GPU node: NVML plus the host paths the
// driver needs beside it. On a real node HostRoot is "/"; a fake node points it
// at a directory tree it made, so the same code reads sysfs, /proc/devices and
// device nodes in both cases.
type Node struct {
	// NVML is the initialised library.
	NVML Library
	// HostRoot holds sys/, proc/devices and dev/ as the host sees them.
	HostRoot string
	// DriverRoot holds the NVIDIA user-space driver (libraries, tools).
	DriverRoot string
	// HostDriverRoot is DriverRoot as the host (its container runtime)
	// sees it; empty means the same path. It differs where the plugin's
	// container mounts the host's driver root elsewhere (the chart mounts
	// it at /driver-root).
	HostDriverRoot string
	// Profile names the fake node profile, empty on real hardware.
	Profile string
	// Nodes makes device nodes the driver creates only on demand (MIG
	// capability and IMEX channel nodes) under DevRoot.
	Nodes NodeMaker
}

// SysfsRoot is where PCI topology is read from.
func (n *Node) SysfsRoot() string { return filepath.Join(n.HostRoot, "sys") }

// DevRoot is the directory whose dev/ holds the NVIDIA device nodes: the
// driver root when a containerised driver put them there, else the host root.
func (n *Node) DevRoot() string {
	if _, err := os.Stat(filepath.Join(n.DriverRoot, "dev", "nvidiactl")); err == nil {
		return n.DriverRoot
	}
	return n.HostRoot
}

// OnHost is the host's path of p, a path this process sees: paths under
// the driver root are moved to the host's driver root (HostDriverRoot).
func (n *Node) OnHost(p string) string {
	if n.HostDriverRoot == "" || n.HostDriverRoot == n.DriverRoot {
		return p
	}
	rel, err := filepath.Rel(n.DriverRoot, p)
	if err != nil || rel == ".." || strings.HasPrefix(rel, "../") {
		return p
	}
	return filepath.Join(n.HostDriverRoot, rel)
}

// Close shuts NVML down.
func (n *Node) Close() error {
	if ret := n.NVML.Shutdown(); ret != nvml.SUCCESS {
		return fmt.Errorf("shut down NVML: %w", Error(ret))
	}
	return nil
}

// ErrNoLibrary reports that the NVML library could not be loaded.
var ErrNoLibrary = errors.New("NVML library libnvidia-ml.so.1 not found")

// OpenReal loads the NVML library of the NVIDIA driver under driverRoot ("/"
// for a host-installed driver) and initialises it.
func OpenReal(driverRoot string) (*Node, error) {
	if driverRoot == "" {
		driverRoot = "/"
	}
	var opts []nvml.LibraryOption
	if path := findLibrary(driverRoot, "libnvidia-ml.so.1"); path != "" {
		opts = append(opts, nvml.WithLibraryPath(path))
	}
	lib := nvml.New(opts...)
	if ret := lib.Init(); ret != nvml.SUCCESS {
		if ret == nvml.ERROR_LIBRARY_NOT_FOUND {
			return nil, fmt.Errorf("%w under driver root %q: install the NVIDIA driver, point --driver-root at it, or run with --fake-node=<profile> for a simulated node", ErrNoLibrary, driverRoot)
		}
		return nil, fmt.Errorf("initialise NVML: %w", Error(ret))
	}
	return &Node{NVML: lib, HostRoot: "/", DriverRoot: driverRoot, Nodes: Mknod{}}, nil
}

// libDirs are where distributions install the NVIDIA user-space libraries.
var libDirs = []string{
	"usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "usr/lib64", "lib64",
	"usr/lib", "lib/x86_64-linux-gnu", "lib/aarch64-linux-gnu",
}

func findLibrary(root, name string) string {
	for _, dir := range libDirs {
		p := filepath.Join(root, dir, name)
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	return ""
}

// Error turns an NVML return code into an error (nil for SUCCESS).
func Error(ret nvml.Return) error {
	if ret == nvml.SUCCESS {
		return nil
	}
	return returnError(ret)
}

type returnError nvml.Return

func (e returnError) Error() string {
	return fmt.Sprintf("NVML: %s (code %d)", nvml.ErrorString(nvml.Return(e)), int(e))
}

// IsNotSupported says whether err is NVML's "not supported", which Tessera
// treats as "this GPU lacks the feature" rather than as a failure.
func IsNotSupported(err error) bool {
	var re returnError
	return errors.As(err, &re) && nvml.Return(re) == nvml.ERROR_NOT_SUPPORTED
}

// IsGPULost says whether err is NVML's "GPU is lost": the GPU fell off the
// bus and answers nothing until it is reset or the node reboots.
func IsGPULost(err error) bool {
	var re returnError
	return errors.As(err, &re) && nvml.Return(re) == nvml.ERROR_GPU_IS_LOST
}
