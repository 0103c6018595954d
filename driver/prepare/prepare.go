package prepare

import (
	"context"
	"fmt"
	"slices"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2"

	"github.com/tessera-dev/tessera/cdi"
	"github.com/tessera-dev/tessera/driver/checkpoint"
)

// Prepare makes the claim's devices on this node usable by containers and
// returns them with their CDI device IDs.
func (m *Manager) Prepare(ctx context.Context, claim *resourceapi.ResourceClaim) ([]kubeletplugin.Device, error) {
	uid := claim.UID
	ref := claimRef(claim.Namespace, claim.Name)
	want, err := m.allocatedHere(claim)
	if err != nil {
		return nil, fmt.Errorf("claim %s: %w", ref, err)
	}
	unlock := m.claimLocks.lock(uid)
	defer unlock()

	m.mu.Lock()
	if c, ok := m.data.Claims[string(uid)]; ok && c.Phase == checkpoint.PrepareCompleted {
		m.mu.Unlock()
		if !sameDevices(c.Devices, want) {
			return nil, fmt.Errorf("claim %s: already prepared with devices %s, now allocated %s; unprepare it first", ref, names(c.Devices), names(want))
		}
		klog.FromContext(ctx).V(4).Info("Claim already prepared", "claim", ref)
		return results(c.Devices), nil
	}
	if err := m.reserve(uid, ref, want); err != nil {
		m.mu.Unlock()
		return nil, err
	}
	m.data.Claims[string(uid)] = checkpoint.Claim{Namespace: claim.Namespace, Name: claim.Name, Phase: checkpoint.PrepareStarted, Devices: want}
	if err := m.save(); err != nil {
		m.release(uid, want)
		delete(m.data.Claims, string(uid))
		m.mu.Unlock()
		return nil, fmt.Errorf("claim %s: %w", ref, err)
	}
	m.mu.Unlock()

	prepared, err := m.writeCDI(claim, want)
	if err != nil {
		m.rollback(ctx, uid, want)
		return nil, fmt.Errorf("claim %s: %w", ref, err)
	}

	m.mu.Lock()
	defer m.mu.Unlock()
	m.data.Claims[string(uid)] = checkpoint.Claim{Namespace: claim.Namespace, Name: claim.Name, Phase: checkpoint.PrepareCompleted, Devices: prepared}
	if err := m.save(); err != nil {
		// The CDI spec exists but the checkpoint says PrepareStarted: a
		// restart rolls it back, and the kubelet retries.
		return nil, fmt.Errorf("claim %s: %w", ref, err)
	}
	return results(prepared), nil
}

// Unprepare releases a claim's devices. Unknown claims succeed.
func (m *Manager) Unprepare(ctx context.Context, uid types.UID) error {
	unlock := m.claimLocks.lock(uid)
	defer unlock()

	m.mu.Lock()
	c, ok := m.data.Claims[string(uid)]
	if !ok {
		m.mu.Unlock()
		// Nothing recorded; a spec could still be left by a lost checkpoint.
		return m.cfg.CDI.Remove(string(uid))
	}
	c.Phase = checkpoint.UnprepareStarted
	m.data.Claims[string(uid)] = c
	if err := m.save(); err != nil {
		m.mu.Unlock()
		return fmt.Errorf("claim %s: %w", claimRef(c.Namespace, c.Name), err)
	}
	m.mu.Unlock()

	if err := m.cfg.CDI.Remove(string(uid)); err != nil {
		return fmt.Errorf("claim %s: %w", claimRef(c.Namespace, c.Name), err)
	}

	m.mu.Lock()
	defer m.mu.Unlock()
	m.release(uid, c.Devices)
	delete(m.data.Claims, string(uid))
	if err := m.save(); err != nil {
		return fmt.Errorf("claim %s: %w", claimRef(c.Namespace, c.Name), err)
	}
	klog.FromContext(ctx).V(2).Info("Claim unprepared", "claim", claimRef(c.Namespace, c.Name), "uid", uid)
	return nil
}

// allocatedHere returns the claim's allocation results for this driver and
// node, checking each names a device this node has.
func (m *Manager) allocatedHere(claim *resourceapi.ResourceClaim) ([]checkpoint.Device, error) {
	if claim.Status.Allocation == nil {
		return nil, fmt.Errorf("not allocated")
	}
	var out []checkpoint.Device
	for _, r := range claim.Status.Allocation.Devices.Results {
		if r.Driver != m.cfg.DriverName || r.Pool != m.cfg.PoolName {
			continue
		}
		if _, ok := m.gpus[r.Device]; !ok {
			return nil, fmt.Errorf("allocated device %s does not exist on node %s (known: %s)", r.Device, m.cfg.PoolName, strings.Join(m.deviceNames(), ", "))
		}
		out = append(out, checkpoint.Device{
			Requests:    []string{r.Request},
			Pool:        r.Pool,
			Device:      r.Device,
			AdminAccess: r.AdminAccess != nil && *r.AdminAccess,
		})
	}
	return out, nil
}

// reserve takes exclusive ownership of the claim's devices; m.mu held.
func (m *Manager) reserve(uid types.UID, ref string, devs []checkpoint.Device) error {
	for _, d := range devs {
		if d.AdminAccess {
			continue
		}
		if holder, ok := m.owners[d.Device]; ok && holder != uid {
			h := m.data.Claims[string(holder)]
			return fmt.Errorf("claim %s: device %s is already prepared for claim %s (%s); unprepare it first", ref, d.Device, claimRef(h.Namespace, h.Name), holder)
		}
	}
	for _, d := range devs {
		if !d.AdminAccess {
			m.owners[d.Device] = uid
		}
	}
	return nil
}

// release gives up the claim's devices; m.mu held.
func (m *Manager) release(uid types.UID, devs []checkpoint.Device) {
	for _, d := range devs {
		if m.owners[d.Device] == uid {
			delete(m.owners, d.Device)
		}
	}
}

// rollback undoes a prepare that failed after its started mark.
func (m *Manager) rollback(ctx context.Context, uid types.UID, devs []checkpoint.Device) {
	if err := m.cfg.CDI.Remove(string(uid)); err != nil {
		klog.FromContext(ctx).Error(err, "Rolling back a failed prepare: CDI spec left behind; it is removed at the next start", "uid", uid)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.release(uid, devs)
	delete(m.data.Claims, string(uid))
	if err := m.save(); err != nil {
		klog.FromContext(ctx).Error(err, "Rolling back a failed prepare: checkpoint not updated; the next start rolls it back", "uid", uid)
	}
}

// writeCDI writes the claim's CDI spec and returns the devices with their IDs.
func (m *Manager) writeCDI(claim *resourceapi.ResourceClaim, devs []checkpoint.Device) ([]checkpoint.Device, error) {
	spec := cdi.ClaimSpec{ClaimUID: string(claim.UID), ClaimNamespace: claim.Namespace, ClaimName: claim.Name}
	var uuids []string
	seen := map[string]bool{}
	for _, d := range devs {
		if seen[d.Device] {
			continue // one device may serve several requests
		}
		seen[d.Device] = true
		g := m.gpus[d.Device]
		uuids = append(uuids, g.UUID)
		spec.Devices = append(spec.Devices, cdi.Device{
			Name:        d.Device,
			DeviceNodes: []cdi.DeviceNode{m.cfg.DevNodes.GPU(g.Minor)},
			Env:         []string{"TESSERA_GPU_" + strings.ReplaceAll(strings.TrimPrefix(d.Device, "gpu-"), "-", "_") + "_UUID=" + g.UUID},
		})
	}
	if len(spec.Devices) == 0 {
		return devs, nil
	}
	spec.Common = cdi.Edits{
		DeviceNodes: m.cfg.DevNodes.Control(),
		Env:         []string{"NVIDIA_VISIBLE_DEVICES=" + strings.Join(uuids, ",")},
		Mounts:      m.cfg.DriverFiles.Mounts,
	}
	ids, err := m.cfg.CDI.Write(spec)
	if err != nil {
		return nil, err
	}
	out := make([]checkpoint.Device, len(devs))
	for i, d := range devs {
		d.CDIDeviceIDs = []string{ids[d.Device]}
		out[i] = d
	}
	return out, nil
}

func (m *Manager) deviceNames() []string {
	out := make([]string, 0, len(m.gpus))
	for n := range m.gpus {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

func results(devs []checkpoint.Device) []kubeletplugin.Device {
	out := make([]kubeletplugin.Device, 0, len(devs))
	for _, d := range devs {
		out = append(out, kubeletplugin.Device{
			Requests:     d.Requests,
			PoolName:     d.Pool,
			DeviceName:   d.Device,
			CDIDeviceIDs: d.CDIDeviceIDs,
		})
	}
	return out
}

func sameDevices(a, b []checkpoint.Device) bool {
	key := func(ds []checkpoint.Device) []string {
		out := make([]string, 0, len(ds))
		for _, d := range ds {
			out = append(out, d.Pool+"/"+d.Device+"/"+strings.Join(d.Requests, ","))
		}
		slices.Sort(out)
		return out
	}
	return slices.Equal(key(a), key(b))
}

func names(ds []checkpoint.Device) string {
	out := make([]string, 0, len(ds))
	for _, d := range ds {
		out = append(out, d.Device)
	}
	return "[" + strings.Join(out, ", ") + "]"
}

func claimRef(namespace, name string) string { return namespace + "/" + name }
