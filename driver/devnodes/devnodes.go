// Package devnodes says which device nodes a container needs for a GPU and
// what their numbers are, reading the host (stat, /proc/devices) rather than
// assuming: nvidia-uvm's major is assigned at module load.
package devnodes

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/tessera-dev/tessera/cdi"
)

// NvidiaMajor is the NVIDIA character devices' fixed major number.
const NvidiaMajor = 195

// ctlMinor is /dev/nvidiactl's minor number.
const ctlMinor = 255

// Resolver finds device nodes under a dev root and their numbers.
type Resolver struct {
	// DevRoot holds dev/ (the host root, or a containerised driver's root).
	DevRoot string
	// HostRoot holds proc/devices.
	HostRoot string
	// HostDevRoot is DevRoot as the host sees it, for the host paths of
	// the nodes; empty means DevRoot.
	HostDevRoot string
	uvmMajor    int64
	// capsMajor and migMinors number the MIG capability devices.
	capsMajor int64
	migMinors map[string]int64
	// imexMajor numbers the IMEX channel devices (imex.go); 0 when the
	// host has none.
	imexMajor int64
}

// New reads what the host says about NVIDIA's device numbers.
func New(devRoot, hostRoot string) (*Resolver, error) {
	r := &Resolver{DevRoot: devRoot, HostRoot: hostRoot}
	majors, err := readProcDevices(filepath.Join(hostRoot, "proc", "devices"))
	if err != nil {
		return nil, err
	}
	r.uvmMajor = majors["nvidia-uvm"]
	r.capsMajor = majors["nvidia-caps"]
	r.imexMajor = majors[imexDevice]
	r.migMinors, err = readMIGMinors(filepath.Join(hostRoot, "proc", "driver", "nvidia-caps", "mig-minors"))
	if err != nil {
		return nil, err
	}
	return r, nil
}

// MIG lists the nodes a container needs for one MIG device besides its
// parent GPU's node: the capability devices granting access to the GPU
// instance and to the compute instance.
func (r *Resolver) MIG(parentMinor, gpuInstance, computeInstance int) ([]cdi.DeviceNode, error) {
	if r.capsMajor == 0 || r.migMinors == nil {
		return nil, fmt.Errorf("the nvidia-caps device is not registered on this host (no nvidia-caps in /proc/devices or no mig-minors): MIG devices cannot be injected")
	}
	var out []cdi.DeviceNode
	for _, key := range []string{
		fmt.Sprintf("gpu%d/gi%d/access", parentMinor, gpuInstance),
		fmt.Sprintf("gpu%d/gi%d/ci%d/access", parentMinor, gpuInstance, computeInstance),
	} {
		minor, ok := r.migMinors[key]
		if !ok {
			return nil, fmt.Errorf("no MIG capability minor for %s", key)
		}
		out = append(out, r.node(fmt.Sprintf("/dev/nvidia-caps/nvidia-cap%d", minor), r.capsMajor, minor))
	}
	return out, nil
}

// readMIGMinors reads the kernel's table of MIG capability minors; a host
// without MIG support has none.
func readMIGMinors(path string) (map[string]int64, error) {
	data, err := os.ReadFile(path)
	if os.IsNotExist(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read MIG capability minors: %w", err)
	}
	out := map[string]int64{}
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) != 2 {
			continue
		}
		if n, err := strconv.ParseInt(f[1], 10, 64); err == nil {
			out[f[0]] = n
		}
	}
	return out, nil
}

// GPU is the device node of the GPU with the given minor number.
func (r *Resolver) GPU(minor int) cdi.DeviceNode {
	return r.node(fmt.Sprintf("/dev/nvidia%d", minor), NvidiaMajor, int64(minor))
}

// Control lists the nodes every CUDA container needs beside its GPUs.
// nvidia-uvm is left out when the module is not loaded (no major number).
func (r *Resolver) Control() []cdi.DeviceNode {
	out := []cdi.DeviceNode{r.node("/dev/nvidiactl", NvidiaMajor, ctlMinor)}
	if r.uvmMajor > 0 {
		out = append(out, r.node("/dev/nvidia-uvm", r.uvmMajor, 0), r.node("/dev/nvidia-uvm-tools", r.uvmMajor, 1))
	}
	return out
}

// modesetMinor is /dev/nvidia-modeset's minor number.
const modesetMinor = 254

// Modeset is the display mode-setting node graphics containers need.
func (r *Resolver) Modeset() cdi.DeviceNode {
	return r.node("/dev/nvidia-modeset", NvidiaMajor, modesetMinor)
}

// node prefers the numbers of a real device node on the host and falls back on
// the expected ones (fake nodes use regular files).
func (r *Resolver) node(path string, major, minor int64) cdi.DeviceNode {
	host := filepath.Join(r.DevRoot, path)
	var st unix.Stat_t
	if err := unix.Stat(host, &st); err == nil && st.Mode&unix.S_IFMT == unix.S_IFCHR {
		major, minor = int64(unix.Major(st.Rdev)), int64(unix.Minor(st.Rdev))
	}
	if r.HostDevRoot != "" {
		host = filepath.Join(r.HostDevRoot, path)
	}
	return cdi.DeviceNode{Path: path, HostPath: host, Major: major, Minor: minor}
}

// readProcDevices maps character device names to majors.
func readProcDevices(path string) (map[string]int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("read device numbers: %w", err)
	}
	defer func() { _ = f.Close() }()
	out := map[string]int64{}
	sc := bufio.NewScanner(f)
	inChar := false
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case line == "Character devices:":
			inChar = true
			continue
		case line == "" || strings.HasSuffix(line, "devices:"):
			inChar = false
			continue
		}
		if !inChar {
			continue
		}
		fields := strings.Fields(line)
		if len(fields) != 2 {
			continue
		}
		if n, err := strconv.ParseInt(fields[0], 10, 64); err == nil {
			out[fields[1]] = n
		}
	}
	return out, sc.Err()
}
