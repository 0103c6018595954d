package prepare

import (
	resourceapi "k8s.io/api/resource/v1"

	"github.com/tessera-dev/tessera/api/gpu/v1alpha1"
	"github.com/tessera-dev/tessera/cdi"
	"github.com/tessera-dev/tessera/driver/driverfiles"
	"github.com/tessera-dev/tessera/driver/inventory"
)

// DriverEdits gives the driver files and hook a claim's containers get for
// what its devices can do (driverfiles.Files.Edits).
type DriverEdits func(driverfiles.Need) (cdi.Edits, error)

// driverEdits are the driver files for a claim's devices: Config.DriverEdits
// when set, else Config.DriverFiles as they are. A claim whose GpuConfig
// asks for graphics also gets /dev/nvidia-modeset.
func (m *Manager) driverEdits(claim *resourceapi.ResourceClaim, devs []inventory.Device) (cdi.Edits, error) {
	if m.cfg.DriverEdits == nil {
		return m.cfg.DriverFiles, nil
	}
	n := need(devs)
	configs, err := m.decodeConfigs(claim)
	if err != nil {
		return cdi.Edits{}, err
	}
	var applied []v1alpha1.Config
	for _, c := range configs {
		applied = append(applied, c.cfg)
	}
	if gpu, _ := v1alpha1.Merge(applied...); gpu != nil && gpu.Graphics != nil && *gpu.Graphics {
		n.Graphics = true
	}
	edits, err := m.cfg.DriverEdits(n)
	if err != nil {
		return cdi.Edits{}, err
	}
	if n.Graphics {
		edits.DeviceNodes = append(edits.DeviceNodes, m.cfg.DevNodes.Modeset())
	}
	return edits, nil
}

// need says which engines the devices have: a whole GPU every engine its
// board has (every board Tessera knows decodes video; the libraries of an
// engine a board lacks load and report none), a MIG device those of its
// profile.
func need(devs []inventory.Device) driverfiles.Need {
	var n driverfiles.Need
	for _, d := range devs {
		if d.Kind == inventory.Whole {
			return driverfiles.Need{Decoders: true, Encoders: true, OpticalFlow: true}
		}
		n.Decoders = n.Decoders || d.Profile.Decoders > 0
		n.Encoders = n.Encoders || d.Profile.Encoders > 0
		n.OpticalFlow = n.OpticalFlow || d.Profile.OFAs > 0
	}
	return n
}
