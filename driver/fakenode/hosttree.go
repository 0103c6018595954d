package fakenode

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

// Device numbers the fake host reports in /proc/devices. 195 is NVIDIA's fixed
// major; nvidia-uvm gets a dynamic one on real hosts.
const (
	NvidiaMajor = 195
	UVMMajor    = 235
	CapsMajor   = 236
)

// migMinors numbers the MIG capability devices as the kernel module does:
// config, monitor, then every GPU instance and its compute instances in order.
func migMinors() string {
	var b strings.Builder
	b.WriteString("config 1\nmonitor 2\n")
	n := 3
	for gpu := 0; gpu < 32; gpu++ {
		for gi := 0; gi < 15; gi++ {
			fmt.Fprintf(&b, "gpu%d/gi%d/access %d\n", gpu, gi, n)
			n++
			for ci := 0; ci < 8; ci++ {
				fmt.Fprintf(&b, "gpu%d/gi%d/ci%d/access %d\n", gpu, gi, ci, n)
				n++
			}
		}
	}
	return b.String()
}

// writeHostTree lays out the files a real GPU node has beside NVML. Device
// nodes are plain files: nothing opens them, and CDI specs carry their numbers.
func writeHostTree(dir string, p Profile, devs []*server.Device) error {
	for i, d := range devs {
		pl := p.GPUs[i]
		devPath := filepath.Join("devices", pl.PCIeRoot, bridgeBDF(pl), pl.BusID)
		if err := mkfile(filepath.Join(dir, "sys", devPath, "numa_node"), fmt.Sprintf("%d\n", pl.NUMANode), 0o644); err != nil {
			return err
		}
		link := filepath.Join(dir, "sys", "bus", "pci", "devices", pl.BusID)
		if err := os.MkdirAll(filepath.Dir(link), 0o755); err != nil {
			return err
		}
		_ = os.Remove(link)
		if err := os.Symlink(filepath.Join("..", "..", "..", devPath), link); err != nil {
			return err
		}
		if err := mkfile(filepath.Join(dir, "dev", fmt.Sprintf("nvidia%d", d.Minor)), "", 0o666); err != nil {
			return err
		}
	}
	for _, n := range []string{"nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"} {
		if err := mkfile(filepath.Join(dir, "dev", n), "", 0o666); err != nil {
			return err
		}
	}
	procDevices := fmt.Sprintf("Character devices:\n  1 mem\n%d nvidia-frontend\n%d nvidia-uvm\n%d nvidia-caps\n%s\nBlock devices:\n  8 sd\n", NvidiaMajor, UVMMajor, CapsMajor, imexProcDevices(p))
	if err := mkfile(filepath.Join(dir, "proc", "devices"), procDevices, 0o444); err != nil {
		return err
	}
	if err := mkfile(filepath.Join(dir, "proc", "driver", "nvidia-caps", "mig-minors"), migMinors(), 0o444); err != nil {
		return err
	}
	return InstallDriver(dir, p.GPU.LibDir, p.DriverVersion)
}

// bridgeBDF names the upstream bridge of a GPU: one per PCIe switch.
func bridgeBDF(pl Placement) string {
	var domain, bus uint32
	fmt.Sscanf(pl.BusID, "%x:%x", &domain, &bus)
	var root uint32
	fmt.Sscanf(pl.PCIeRoot, "pci%x:%x", &domain, &root)
	h := uint32(0)
	for _, c := range pl.Switch {
		h = h*31 + uint32(c)
	}
	return fmt.Sprintf("%04x:%02x:%02x.0", domain, root, 1+h%30)
}
