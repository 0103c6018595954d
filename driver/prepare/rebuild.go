package prepare

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/klog/v2"

	"github.com/tessera-dev/tessera/cdi"
	"github.com/tessera-dev/tessera/driver/checkpoint"
)

// Rebuilding a lost checkpoint from the CDI specs. Each claim's spec
// carries the claim's checkpoint record, with the originals of the GPU
// settings it needs (checkpoint.ClaimRecord), written with the spec: a
// rebuilt checkpoint holds every field the lost one held for the claims
// whose specs exist. A spec of an earlier release carries none; its claim is
// rebuilt from what the spec shows, and what the spec cannot tell (request
// names, share IDs and memory, GPU settings and their originals) is left as
// it is on the node, never undone.

// errNoRecord marks a spec written before specs carried a claim record.
var errNoRecord = errors.New("the spec carries no claim record")

// rebuildFromCDI reconstructs prepared claims from the CDI specs, which are
// written before a prepare completes and removed before an unprepare does.
// Specs of an earlier boot are left out (and then removed as orphans): on a
// CDI directory that survives reboots they would otherwise come back as
// prepared claims whose partitions and containers are gone.
func (m *Manager) rebuildFromCDI(ctx context.Context) (checkpoint.Data, error) {
	logger := klog.FromContext(ctx)
	specs, err := m.cfg.CDI.List()
	if err != nil {
		logger.Error(err, "Some CDI specs could not be read while rebuilding the checkpoint; they are left out")
	}
	data := checkpoint.Data{BootID: m.cfg.BootID, Claims: map[string]checkpoint.Claim{}}
	var shown []string // claims rebuilt from what their spec shows
	for _, s := range specs {
		if s.BootID != "" && s.BootID != m.cfg.BootID {
			logger.Info("Leaving out a CDI spec of an earlier boot", "claim", klog.KRef(s.ClaimNamespace, s.ClaimName), "uid", s.ClaimUID, "specBootID", s.BootID)
			continue
		}
		r, err := claimFromRecord(s)
		if err != nil {
			if !errors.Is(err, errNoRecord) {
				logger.Error(err, "Rebuilding a claim from its CDI spec alone", "claim", klog.KRef(s.ClaimNamespace, s.ClaimName), "uid", s.ClaimUID)
			}
			r = checkpoint.ClaimRecord{Claim: m.claimFromSpec(s)}
			shown = append(shown, s.ClaimUID)
		}
		data.Claims[s.ClaimUID] = r.Claim
		for gpu, o := range r.GPUs {
			// Every claim needing a setting carries the same original:
			// it is recorded once and kept while any claim needs it.
			if data.GPUs == nil {
				data.GPUs = map[string]checkpoint.GPUOriginal{}
			}
			have := data.GPUs[gpu]
			if have.ComputeMode == nil {
				have.ComputeMode = o.ComputeMode
			}
			if have.PowerLimitMW == nil {
				have.PowerLimitMW = o.PowerLimitMW
			}
			data.GPUs[gpu] = have
		}
	}
	observeAmbiguous(ctx, data, shown)
	m.recordDomainSpecs(ctx, &data)
	return data, nil
}

// observeAmbiguous rebuilds as observers (admin access: holding nothing,
// destroying nothing) the devices of claims rebuilt from their spec alone
// (shown) that another rebuilt claim names too. Such a spec cannot say
// whether its claim owned the device or observed it with admin access: an
// owner's and an observer's spec of one partition look alike. Rebuilt as
// owner, an observer's unprepare would destroy the partition the other
// claim's pods use. The partition is left as it is on the node.
func observeAmbiguous(ctx context.Context, data checkpoint.Data, shown []string) {
	named := map[string]int{}
	for _, c := range data.Claims {
		seen := map[string]bool{} // one device may serve several requests
		for _, d := range c.Devices {
			if d.AdminAccess || d.ShareID != "" || seen[d.Device] {
				continue
			}
			seen[d.Device] = true
			named[d.Device]++
		}
	}
	for _, uid := range shown {
		c := data.Claims[uid]
		for i, d := range c.Devices {
			if named[d.Device] < 2 {
				continue
			}
			klog.FromContext(ctx).Info("A device named by several claims' specs is rebuilt as observed by this one: its spec cannot tell an owner from an admin-access observer, and what it holds is left as it is", "claim", klog.KRef(c.Namespace, c.Name), "uid", uid, "device", d.Device)
			c.Devices[i].AdminAccess, c.Devices[i].MIG = true, nil
		}
	}
}

// claimFromRecord reads the claim record a spec carries, checking that it
// is the record of the spec's claim and devices.
func claimFromRecord(s cdi.ClaimSpec) (checkpoint.ClaimRecord, error) {
	if s.Record == "" {
		return checkpoint.ClaimRecord{}, errNoRecord
	}
	r, err := checkpoint.DecodeClaimRecord(s.Record)
	if err != nil {
		return checkpoint.ClaimRecord{}, err
	}
	c := r.Claim
	var recorded, specified []string
	for _, d := range c.Devices {
		if !slices.Contains(recorded, d.Device) {
			recorded = append(recorded, d.Device)
		}
	}
	for _, d := range s.Devices {
		specified = append(specified, d.Name)
	}
	slices.Sort(recorded)
	slices.Sort(specified)
	if c.Namespace != s.ClaimNamespace || c.Name != s.ClaimName || !slices.Equal(recorded, specified) {
		return checkpoint.ClaimRecord{}, fmt.Errorf("the spec's claim record is of claim %s with devices %v, the spec of %s with devices %v", claimRef(c.Namespace, c.Name), recorded, claimRef(s.ClaimNamespace, s.ClaimName), specified)
	}
	// The spec exists, so the prepare got at least as far as writing it.
	c.Phase = checkpoint.PrepareCompleted
	for i := range c.Devices {
		c.Devices[i].CDIDeviceIDs = []string{cdi.DeviceID(s.ClaimUID, c.Devices[i].Device)}
	}
	r.Claim = c
	return r, nil
}

// claimFromSpec reconstructs a claim from what a spec without a record
// shows: its names, devices, MIG partitions, and the MPS daemon its mounts
// reach, so that the daemon its pods use is not taken for an orphan.
func (m *Manager) claimFromSpec(s cdi.ClaimSpec) checkpoint.Claim {
	c := checkpoint.Claim{Namespace: s.ClaimNamespace, Name: s.ClaimName, Phase: checkpoint.PrepareCompleted}
	for _, d := range s.Devices {
		dev := checkpoint.Device{
			Pool:         m.cfg.PoolName,
			Device:       d.Name,
			CDIDeviceIDs: []string{cdi.DeviceID(s.ClaimUID, d.Name)},
		}
		// Keep the partition's record, or it would be taken for an orphan,
		// with the UUID the spec gave the container: the partition's
		// identity, which every destroy matches (observeAmbiguous drops
		// the record where the spec may be an observer's).
		if inv, ok := m.inventory().Lookup(d.Name); ok {
			dev.MIG = migRecord(inv)
			if dev.MIG != nil {
				dev.MIG.UUID = envValue(d.Env, uuidEnv(d.Name))
			}
		}
		c.Devices = append(c.Devices, dev)
	}
	if m.cfg.MPS != nil {
		loc := m.cfg.MPS.Locate(s.ClaimUID)
		for _, mt := range s.Common.Mounts {
			if loc.Dir != "" && strings.HasPrefix(mt.HostPath, loc.Dir+string(filepath.Separator)) {
				c.MPS = &loc
				break
			}
		}
	}
	return c
}

// specRecord is what the claim's CDI spec keeps of it for a rebuild: the
// record the checkpoint will hold once the claim is prepared (CDI device
// IDs aside, which follow from the spec), and the originals of the GPU
// settings it needs, recorded by then.
func (m *Manager) specRecord(claim *resourceapi.ResourceClaim, devs []checkpoint.Device, daemon *checkpoint.MPSDaemon) (string, error) {
	r := checkpoint.ClaimRecord{Claim: checkpoint.Claim{Namespace: claim.Namespace, Name: claim.Name, Phase: checkpoint.PrepareCompleted, Devices: devs, MPS: daemon}}
	m.mu.Lock()
	for _, d := range devs {
		orig, ok := m.data.GPUs[d.GPU]
		if d.Settings == nil || !ok {
			continue
		}
		if r.GPUs == nil {
			r.GPUs = map[string]checkpoint.GPUOriginal{}
		}
		kept := r.GPUs[d.GPU]
		if d.Settings.ComputeMode != "" && orig.ComputeMode != nil {
			v := *orig.ComputeMode
			kept.ComputeMode = &v
		}
		if d.Settings.PowerLimitMW != 0 && orig.PowerLimitMW != nil {
			v := *orig.PowerLimitMW
			kept.PowerLimitMW = &v
		}
		r.GPUs[d.GPU] = kept
	}
	m.mu.Unlock()
	return checkpoint.EncodeClaimRecord(r)
}

// envValue is the value of key in env (KEY=VALUE entries), or "".
func envValue(env []string, key string) string {
	for _, kv := range env {
		if k, v, ok := strings.Cut(kv, "="); ok && k == key {
			return v
		}
	}
	return ""
}
