package fakenode

import (
	"fmt"
	"sync"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

// settings is a GPU's administrator-set state that survives a driver's
// process: its power limit and compute mode. A fresh GPU runs at its default
// power limit in compute mode Default, as a real board after boot.
type settings struct {
	mu          sync.Mutex
	powerMW     uint32
	computeMode nvml.ComputeMode
}

// completeSettings lets the driver read and change the power limit and the
// compute mode as NVML does: a limit outside the board's constraints is
// refused with INVALID_ARGUMENT, like the real call. Changes are logged,
// and changed is called after each that succeeded.
func completeSettings(d *server.Device, i int, p Profile, log *callLog, changed func()) *settings {
	name := fmt.Sprintf("gpu-%d", i)
	lim := powerLimits(p.GPU)
	s := &settings{powerMW: lim.def, computeMode: nvml.COMPUTEMODE_DEFAULT}
	d.GetPowerManagementLimitFunc = func() (uint32, nvml.Return) {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.powerMW, nvml.SUCCESS
	}
	d.GetEnforcedPowerLimitFunc = d.GetPowerManagementLimitFunc
	setPower := func(mw uint32) nvml.Return {
		s.mu.Lock()
		defer s.mu.Unlock()
		log.add("%s SetPowerManagementLimit(%d)", name, mw)
		if mw < lim.min || mw > lim.max {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		s.powerMW = mw
		return nvml.SUCCESS
	}
	d.SetPowerManagementLimitFunc = func(mw uint32) nvml.Return {
		ret := setPower(mw)
		if ret == nvml.SUCCESS {
			changed()
		}
		return ret
	}
	d.GetComputeModeFunc = func() (nvml.ComputeMode, nvml.Return) {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.computeMode, nvml.SUCCESS
	}
	setMode := func(m nvml.ComputeMode) nvml.Return {
		s.mu.Lock()
		defer s.mu.Unlock()
		log.add("%s SetComputeMode(%d)", name, m)
		switch m {
		case nvml.COMPUTEMODE_DEFAULT, nvml.COMPUTEMODE_PROHIBITED, nvml.COMPUTEMODE_EXCLUSIVE_PROCESS:
		default:
			return nvml.ERROR_INVALID_ARGUMENT
		}
		s.computeMode = m
		return nvml.SUCCESS
	}
	d.SetComputeModeFunc = func(m nvml.ComputeMode) nvml.Return {
		ret := setMode(m)
		if ret == nvml.SUCCESS {
			changed()
		}
		return ret
	}
	return s
}

// PowerLimitMW is a GPU's current power limit in milliwatts.
func (n *Node) PowerLimitMW(gpu int) uint32 {
	s := n.settings[gpu]
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.powerMW
}

// ComputeMode is a GPU's current compute mode.
func (n *Node) ComputeMode(gpu int) nvml.ComputeMode {
	s := n.settings[gpu]
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.computeMode
}

// restore sets what a saved state holds (a zero power limit: none saved).
func (s *settings) restore(g savedGPU) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if g.PowerMW != 0 {
		s.powerMW = g.PowerMW
	}
	s.computeMode = nvml.ComputeMode(g.ComputeMode)
}
