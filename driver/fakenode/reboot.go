package fakenode

import (
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

// Reboot resets the GPUs as a node reboot does: every MIG instance is gone,
// power limits and compute modes are back at their defaults. MIG mode is a
// persistent setting and stays. The operator's static MIG layout
// (Profile.MIGInstances) is created again, as boot-time MIG configuration
// would.
func (n *Node) Reboot() error {
	def := powerLimits(n.Profile.GPU).def
	for i, dev := range n.Server.Devices {
		d := dev.(*server.Device)
		d.Lock()
		clear(d.GpuInstances)
		d.GpuInstanceCounter = 0
		d.Unlock()
		s := n.settings[i]
		s.mu.Lock()
		s.powerMW, s.computeMode = def, nvml.COMPUTEMODE_DEFAULT
		s.mu.Unlock()
		if insts := n.Profile.MIGInstances[i]; len(insts) > 0 {
			if err := createStatic(d, n.Profile.GPU.MIG, insts); err != nil {
				return fmt.Errorf("fake node %s: gpu-%d: static MIG layout after reboot: %w", n.Profile.Name, i, err)
			}
		}
	}
	n.persist.save()
	return n.PersistError()
}
