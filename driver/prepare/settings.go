package prepare

import (
	"context"
	"fmt"
	"slices"

	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"

	"github.com/tessera-dev/tessera/driver/checkpoint"
)

// GPUSettings reads and changes the GPU settings claims may need
// (gpuset.NVML).
type GPUSettings interface {
	ComputeMode(uuid string) (string, error)
	SetComputeMode(uuid, mode string) error
	PowerLimitMW(uuid string) (uint32, error)
	SetPowerLimitMW(uuid string, mw uint32) error
}

// The settings contract: what a GPU's settings should be is a function of
// the claims holding it (their checkpointed Settings), never of history.
// Before Tessera first changes a setting, the GPU's value is recorded in the
// checkpoint (Data.GPUs); when no claim needs the setting any more, that
// value is restored and the record dropped. reconcileGPU does both and is
// idempotent, so prepare, rollback, unprepare and crash recovery all end by
// calling it.

// wanted is what the claims on one GPU need of it.
type wanted struct {
	computeMode string
	powerMW     uint32
}

// wantedLocked computes a GPU's wanted settings from the claims that hold
// it, leaving out claims being unprepared; m.mu held.
func (m *Manager) wantedLocked(gpu string) wanted {
	var w wanted
	for _, c := range m.data.Claims {
		if c.Phase == checkpoint.UnprepareStarted {
			continue
		}
		for _, d := range c.Devices {
			if d.GPU != gpu || d.Settings == nil {
				continue
			}
			if d.Settings.ComputeMode != "" {
				w.computeMode = d.Settings.ComputeMode
			}
			if d.Settings.PowerLimitMW != 0 {
				w.powerMW = d.Settings.PowerLimitMW
			}
		}
	}
	return w
}

// conflictLocked refuses settings that disagree with those of another
// claim on the same GPU (possible only where claims share a GPU); m.mu held.
func (m *Manager) conflictLocked(uid types.UID, devs []checkpoint.Device) error {
	for _, d := range devs {
		if d.Settings == nil {
			continue
		}
		for other, c := range m.data.Claims {
			if types.UID(other) == uid || c.Phase == checkpoint.UnprepareStarted {
				continue
			}
			for _, o := range c.Devices {
				if o.GPU != d.GPU || o.Settings == nil {
					continue
				}
				if a, b := d.Settings.PowerLimitMW, o.Settings.PowerLimitMW; a != 0 && b != 0 && a != b {
					return fmt.Errorf("device %s: powerLimitWatts %d disagrees with %d W of claim %s, which shares the GPU; use the same limit or none", d.Device, a/1000, b/1000, claimRef(c.Namespace, c.Name))
				}
				if a, b := d.Settings.ComputeMode, o.Settings.ComputeMode; a != "" && b != "" && a != b {
					return fmt.Errorf("device %s: needs compute mode %s, but claim %s on the same GPU needs %s; they cannot share it", d.Device, a, claimRef(c.Namespace, c.Name), b)
				}
			}
		}
	}
	return nil
}

// settingsGPUs lists the GPUs whose settings the devices touch.
func settingsGPUs(devs []checkpoint.Device) []string {
	var out []string
	for _, d := range devs {
		if d.GPU != "" && !slices.Contains(out, d.GPU) {
			out = append(out, d.GPU)
		}
	}
	return out
}

// reconcileGPUs reconciles each GPU, returning the first error. GPU
// settings are shared state (their originals are in the checkpoint): in a
// rolling update this runs under the node lock, and NVML's settings calls,
// which take milliseconds, are all it does there.
func (m *Manager) reconcileGPUs(ctx context.Context, gpus []string) error {
	if len(gpus) == 0 {
		return nil
	}
	return m.locked(ctx, func() error { return m.reconcileHeld(ctx, gpus) })
}

// reconcileHeld is reconcileGPUs with the node lock held.
func (m *Manager) reconcileHeld(ctx context.Context, gpus []string) error {
	var first error
	for _, g := range gpus {
		if err := m.reconcileGPU(ctx, g); err != nil && first == nil {
			first = err
		}
	}
	return first
}

// reconcileGPU brings a GPU's settings to what its claims want: original
// values are checkpointed before the first change and restored when no
// claim wants a setting any more.
func (m *Manager) reconcileGPU(ctx context.Context, gpu string) error {
	if m.cfg.Settings == nil {
		return nil
	}
	unlock := m.gpuLocks.lock(types.UID(gpu))
	defer unlock()
	logger := klog.FromContext(ctx)

	m.mu.Lock()
	want := m.wantedLocked(gpu)
	orig := m.data.GPUs[gpu]
	m.mu.Unlock()

	// Record what is about to change, before changing it.
	record := false
	if want.computeMode != "" && orig.ComputeMode == nil {
		cur, err := m.cfg.Settings.ComputeMode(gpu)
		if err != nil {
			return err
		}
		orig.ComputeMode, record = &cur, true
	}
	if want.powerMW != 0 && orig.PowerLimitMW == nil {
		cur, err := m.cfg.Settings.PowerLimitMW(gpu)
		if err != nil {
			return err
		}
		orig.PowerLimitMW, record = &cur, true
	}
	if record {
		if err := m.storeOriginal(gpu, orig); err != nil {
			return err
		}
	}

	restored := false
	if mode := want.computeMode; mode != "" || orig.ComputeMode != nil {
		if mode == "" {
			mode = *orig.ComputeMode
		}
		cur, err := m.cfg.Settings.ComputeMode(gpu)
		if err != nil {
			return err
		}
		if cur != mode {
			if err := m.cfg.Settings.SetComputeMode(gpu, mode); err != nil {
				return err
			}
			logger.V(2).Info("Set GPU compute mode", "gpu", gpu, "mode", mode, "was", cur)
			settingChanged(want.computeMode == "")
		}
		if want.computeMode == "" {
			orig.ComputeMode, restored = nil, true
		}
	}
	if mw := want.powerMW; mw != 0 || orig.PowerLimitMW != nil {
		if mw == 0 {
			mw = *orig.PowerLimitMW
		}
		cur, err := m.cfg.Settings.PowerLimitMW(gpu)
		if err != nil {
			return err
		}
		if cur != mw {
			if err := m.cfg.Settings.SetPowerLimitMW(gpu, mw); err != nil {
				return err
			}
			logger.V(2).Info("Set GPU power limit", "gpu", gpu, "watts", mw/1000, "wasWatts", cur/1000)
			settingChanged(want.powerMW == 0)
		}
		if want.powerMW == 0 {
			orig.PowerLimitMW, restored = nil, true
		}
	}
	if restored {
		return m.storeOriginal(gpu, orig)
	}
	return nil
}

// settingChanged marks the failure point after a setting changed: back to
// its original, or to what a claim needs.
func settingChanged(restored bool) {
	if restored {
		failpoint(fpSettingRestore)
	} else {
		failpoint(fpSettingChange)
	}
}

// storeOriginal checkpoints a GPU's original settings (dropping the record
// when nothing is left to restore).
func (m *Manager) storeOriginal(gpu string, orig checkpoint.GPUOriginal) error {
	m.mu.Lock()
	if m.data.GPUs == nil {
		m.data.GPUs = map[string]checkpoint.GPUOriginal{}
	}
	if orig.ComputeMode == nil && orig.PowerLimitMW == nil {
		delete(m.data.GPUs, gpu)
	} else {
		m.data.GPUs[gpu] = orig
	}
	v := m.changed()
	m.mu.Unlock()
	// On disk before the setting changes: a crash then restores it.
	return m.persistNow(v)
}

// originalGPUs lists the GPUs with settings to restore or keep.
func (m *Manager) originalGPUs() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]string, 0, len(m.data.GPUs))
	for g := range m.data.GPUs {
		out = append(out, g)
	}
	slices.Sort(out)
	return out
}
