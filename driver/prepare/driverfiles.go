package prepare

import (
	"github.com/tessera-dev/tessera/cdi"
	"github.com/tessera-dev/tessera/driver/driverfiles"
	"github.com/tessera-dev/tessera/driver/inventory"
)

// DriverEdits gives the driver files and hook a claim's containers get for
// what its devices can do (driverfiles.Files.Edits).
type DriverEdits func(driverfiles.Need) (cdi.Edits, error)

// driverEdits are the driver files for a claim's devices: Config.DriverEdits
// when set, else Config.DriverFiles as they are.
func (m *Manager) driverEdits(devs []inventory.Device) (cdi.Edits, error) {
	if m.cfg.DriverEdits == nil {
		return m.cfg.DriverFiles, nil
	}
	return m.cfg.DriverEdits(need(devs))
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
