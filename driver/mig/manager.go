package mig

import (
	"fmt"
	"sync"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/tessera-dev/tessera/driver/gpulib"
)

// Manager creates and destroys MIG instances on a node's GPUs. Work on one
// GPU is serialised (MIG mode and placements are per-GPU state); GPUs do not
// wait for each other.
type Manager struct {
	lib   gpulib.Library
	mu    sync.Mutex
	locks map[string]*sync.Mutex
}

// NewManager returns a manager over an initialised NVML.
func NewManager(lib gpulib.Library) *Manager {
	return &Manager{lib: lib, locks: map[string]*sync.Mutex{}}
}

func (m *Manager) lock(gpuUUID string) (nvml.Device, func(), error) {
	m.mu.Lock()
	l := m.locks[gpuUUID]
	if l == nil {
		l = &sync.Mutex{}
		m.locks[gpuUUID] = l
	}
	m.mu.Unlock()
	l.Lock()
	d, ret := m.lib.DeviceGetHandleByUUID(gpuUUID)
	if ret != nvml.SUCCESS {
		l.Unlock()
		return nil, nil, fmt.Errorf("GPU %s: %w", gpuUUID, gpulib.Error(ret))
	}
	return d, l.Unlock, nil
}

// Create makes a partition, first switching the GPU into MIG mode when it
// can do so without a reset.
func (m *Manager) Create(gpuUUID string, switchable bool, index int, pl Placement) (Instance, error) {
	d, unlock, err := m.lock(gpuUUID)
	if err != nil {
		return Instance{}, err
	}
	defer unlock()
	on, err := Enabled(d)
	if err != nil {
		return Instance{}, err
	}
	if !on {
		if !switchable {
			return Instance{}, fmt.Errorf("GPU %s is not in MIG mode and needs a reset to enter it: an operator must enable MIG mode", gpuUUID)
		}
		if err := SetMode(d, true); err != nil {
			return Instance{}, err
		}
	}
	return Create(d, index, pl)
}

// Destroy removes the partition whose MIG device UUID is uuid (with uuid
// empty: one without a compute instance) at the placement, idempotently, and
// on GPUs that switch without a reset leaves MIG mode once the last partition
// is gone so the whole GPU is usable again. It reports whether it destroyed
// one: another instance at the placement is someone else's and stays.
func (m *Manager) Destroy(gpuUUID string, switchable bool, index int, pl Placement, uuid string) (bool, error) {
	d, unlock, err := m.lock(gpuUUID)
	if err != nil {
		return false, err
	}
	defer unlock()
	destroyed, err := Destroy(d, index, pl, uuid)
	if err != nil || !destroyed {
		return false, err
	}
	if switchable {
		return true, m.leaveIfEmpty(d)
	}
	return true, nil
}

// ExitMIG takes a switchable GPU out of MIG mode for whole-GPU use; it fails
// if partitions still exist.
func (m *Manager) ExitMIG(gpuUUID string) error {
	d, unlock, err := m.lock(gpuUUID)
	if err != nil {
		return err
	}
	defer unlock()
	left, err := Instances(d)
	if err != nil {
		return err
	}
	if len(left) > 0 {
		return fmt.Errorf("GPU %s still has %d MIG instances", gpuUUID, len(left))
	}
	return m.leaveIfEmpty(d)
}

func (m *Manager) leaveIfEmpty(d nvml.Device) error {
	on, err := Enabled(d)
	if err != nil || !on {
		return err
	}
	left, err := Instances(d)
	if err != nil || len(left) > 0 {
		return err
	}
	return SetMode(d, false)
}

// Instances lists a GPU's MIG instances now.
func (m *Manager) Instances(gpuUUID string) ([]Instance, error) {
	d, unlock, err := m.lock(gpuUUID)
	if err != nil {
		return nil, err
	}
	defer unlock()
	return Instances(d)
}
