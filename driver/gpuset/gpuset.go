// Package gpuset reads and changes the GPU settings a claim may need while
// it holds a GPU, through NVML: the compute mode (Default lets the processes
// of several pods share the GPU; ExclusiveProcess leaves it to one MPS
// server) and the board's power limit.
package gpuset

import (
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/tessera-dev/tessera/driver/gpulib"
)

// Compute modes, named as the config API and the checkpoint name them.
const (
	ComputeDefault          = "Default"
	ComputeExclusiveProcess = "ExclusiveProcess"
	ComputeProhibited       = "Prohibited"
)

// NVML changes settings on a node's GPUs.
type NVML struct {
	lib gpulib.Library
}

// New returns settings access through lib.
func New(lib gpulib.Library) *NVML { return &NVML{lib: lib} }

func (n *NVML) device(uuid string) (nvml.Device, error) {
	d, ret := n.lib.DeviceGetHandleByUUID(uuid)
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("GPU %s: %w", uuid, gpulib.Error(ret))
	}
	return d, nil
}

// ComputeMode reads a GPU's compute mode.
func (n *NVML) ComputeMode(uuid string) (string, error) {
	d, err := n.device(uuid)
	if err != nil {
		return "", err
	}
	m, ret := d.GetComputeMode()
	if ret != nvml.SUCCESS {
		return "", fmt.Errorf("GPU %s: read compute mode: %w", uuid, gpulib.Error(ret))
	}
	switch m {
	case nvml.COMPUTEMODE_DEFAULT:
		return ComputeDefault, nil
	case nvml.COMPUTEMODE_EXCLUSIVE_PROCESS:
		return ComputeExclusiveProcess, nil
	case nvml.COMPUTEMODE_PROHIBITED:
		return ComputeProhibited, nil
	}
	return "", fmt.Errorf("GPU %s: unknown compute mode %d", uuid, m)
}

// SetComputeMode changes a GPU's compute mode.
func (n *NVML) SetComputeMode(uuid, mode string) error {
	var m nvml.ComputeMode
	switch mode {
	case ComputeDefault:
		m = nvml.COMPUTEMODE_DEFAULT
	case ComputeExclusiveProcess:
		m = nvml.COMPUTEMODE_EXCLUSIVE_PROCESS
	case ComputeProhibited:
		m = nvml.COMPUTEMODE_PROHIBITED
	default:
		return fmt.Errorf("GPU %s: unknown compute mode %q", uuid, mode)
	}
	d, err := n.device(uuid)
	if err != nil {
		return err
	}
	if ret := d.SetComputeMode(m); ret != nvml.SUCCESS {
		return fmt.Errorf("GPU %s: set compute mode %s: %w", uuid, mode, gpulib.Error(ret))
	}
	return nil
}

// PowerLimitMW reads a GPU's power limit in milliwatts.
func (n *NVML) PowerLimitMW(uuid string) (uint32, error) {
	d, err := n.device(uuid)
	if err != nil {
		return 0, err
	}
	mw, ret := d.GetPowerManagementLimit()
	if ret != nvml.SUCCESS {
		return 0, fmt.Errorf("GPU %s: read power limit: %w", uuid, gpulib.Error(ret))
	}
	return mw, nil
}

// SetPowerLimitMW changes a GPU's power limit.
func (n *NVML) SetPowerLimitMW(uuid string, mw uint32) error {
	d, err := n.device(uuid)
	if err != nil {
		return err
	}
	if ret := d.SetPowerManagementLimit(mw); ret != nvml.SUCCESS {
		return fmt.Errorf("GPU %s: set power limit %d W: %w", uuid, mw/1000, gpulib.Error(ret))
	}
	return nil
}
