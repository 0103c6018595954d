package fakenode

import "fmt"

// IMEXMajor is the major number the fake host gives the IMEX channel devices
// (dynamic on real hosts). Like a real driver, a fake node has no channel
// nodes until one is needed: the plugin makes them (driver/hostnodes).
const IMEXMajor = 237

// imexProcDevices is the /proc/devices line of the IMEX channel devices on a
// node in a multi-node NVLink fabric, and nothing elsewhere.
func imexProcDevices(p Profile) string {
	if p.Fabric == nil {
		return ""
	}
	return fmt.Sprintf("%d nvidia-caps-imex-channels\n", IMEXMajor)
}
