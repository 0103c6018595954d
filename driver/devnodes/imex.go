package devnodes

import (
	"fmt"

	"github.com/tessera-dev/tessera/cdi"
)

// imexDevice is the /proc/devices name of the IMEX channel devices, which
// give a container access to memory exported over a multi-node NVLink fabric.
const imexDevice = "nvidia-caps-imex-channels"

// IMEXChannel is the device node of IMEX channel n
// (/dev/nvidia-caps-imex-channels/channel<n>, minor n). It fails on a host
// whose driver has not registered the IMEX channel devices.
func (r *Resolver) IMEXChannel(n int) (cdi.DeviceNode, error) {
	if r.imexMajor == 0 {
		return cdi.DeviceNode{}, fmt.Errorf("the %s device is not registered on this host (not in %s/proc/devices): load the NVIDIA driver with IMEX channel support on multi-node NVLink nodes", imexDevice, r.HostRoot)
	}
	if n < 0 {
		return cdi.DeviceNode{}, fmt.Errorf("IMEX channel %d: want a channel number of 0 or more", n)
	}
	return r.node(fmt.Sprintf("/dev/%s/channel%d", imexDevice, n), r.imexMajor, int64(n)), nil
}
