package fakenode

import (
	"fmt"
	"path/filepath"
)

// IMEXMajor is the major number the fake host gives the IMEX channel devices
// (dynamic on real hosts).
const IMEXMajor = 237

// IMEXChannels is how many IMEX channel device nodes a fake multi-node NVLink
// host has (real drivers create them on demand, up to 2048).
const IMEXChannels = 16

// imexProcDevices is the /proc/devices line of the IMEX channel devices on a
// node in a multi-node NVLink fabric, and nothing elsewhere.
func imexProcDevices(p Profile) string {
	if p.Fabric == nil {
		return ""
	}
	return fmt.Sprintf("%d nvidia-caps-imex-channels\n", IMEXMajor)
}

// writeIMEXChannels lays out /dev/nvidia-caps-imex-channels/channel<n> on a
// node in a multi-node NVLink fabric (plain files, like every fake node).
func writeIMEXChannels(dir string, p Profile) error {
	if p.Fabric == nil {
		return nil
	}
	for n := range IMEXChannels {
		if err := mkfile(filepath.Join(dir, "dev", "nvidia-caps-imex-channels", fmt.Sprintf("channel%d", n)), "", 0o666); err != nil {
			return err
		}
	}
	return nil
}
