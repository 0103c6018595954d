package prepare

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2"

	"github.com/tessera-dev/tessera/cdi"
	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/inventory"
	"github.com/tessera-dev/tessera/driver/mig"
	published "github.com/tessera-dev/tessera/driver/slices"
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
	mps, err := m.plan(claim, want)
	if err != nil {
		return nil, fmt.Errorf("claim %s: %w", ref, err)
	}
	unlock, err := m.lockClaim(uid)
	if err != nil {
		return nil, fmt.Errorf("claim %s: %w", ref, err)
	}
	defer unlock()

	var st started
	// A record this attempt cannot take over (an unprepare that did not
	// finish, or a started mark of other devices: the claim was allocated
	// again) is settled first, as its unprepare would: its partitions,
	// daemon and settings are undone from it, never dropped with it.
	for settle := true; settle; {
		settle = false
		err = m.locked(ctx, func() error {
			m.mu.Lock()
			c, ok := m.data.Claims[string(uid)]
			if ok && (c.Phase == checkpoint.UnprepareStarted || c.Phase == checkpoint.PrepareStarted && !sameDevices(c.Devices, want)) {
				m.mu.Unlock()
				settle = true
				return nil
			}
			var err error
			st, err = m.markStarted(claim, want, mps, c, ok)
			return err
		})
		if err == nil && settle {
			klog.FromContext(ctx).Info("Finishing what an earlier prepare or unprepare of the claim left before preparing it", "claim", ref)
			if _, err = m.unprepareHeld(ctx, uid, nil); err != nil {
				err = fmt.Errorf("finish what an earlier prepare or unprepare of it left: %w", err)
			}
		}
		if err != nil {
			return nil, fmt.Errorf("claim %s: %w", ref, err)
		}
	}
	rec := st.rec
	if st.done {
		klog.FromContext(ctx).V(4).Info("Claim already prepared", "claim", ref)
		return results(rec.Devices), nil
	}
	failpoint(fpPrepareStarted)

	// The slow work (MIG partitions, the MPS daemon's start) runs outside
	// the node lock: the started mark holds the devices meanwhile.
	prepared, err := m.materialize(ctx, claim, want, mps, rec.MPS, st.earlier)
	if err != nil {
		m.rollback(ctx, uid, rec)
		return nil, fmt.Errorf("claim %s: %w", ref, err)
	}

	rec.Phase, rec.Devices = checkpoint.PrepareCompleted, prepared
	var lost, settled bool
	err = m.locked(ctx, func() error {
		m.mu.Lock()
		// The completed mark goes only over this attempt's started mark.
		// In a rolling update the other instance may have settled it
		// meanwhile: an instance of an earlier release, which knows no
		// claim locks, rolls back every started claim when it starts, and
		// a reload that rebuilt a corrupted checkpoint from the CDI specs
		// knows no claim whose spec is not written yet. Marked completed
		// anyway, the claim would be recorded with partitions destroyed
		// or devices another claim got meanwhile.
		if cur, ok := m.data.Claims[string(uid)]; !ok || cur.Phase != checkpoint.PrepareStarted || !sameDevices(cur.Devices, want) {
			m.mu.Unlock()
			lost, settled = true, ok
			return fmt.Errorf("its started mark was settled by the other plugin instance while this one prepared it; the kubelet's retry prepares it again")
		}
		m.data.Claims[string(uid)] = rec
		v := m.changed()
		m.mu.Unlock()
		if err := m.persist(v); err != nil {
			// The CDI spec exists but the checkpoint says PrepareStarted,
			// and so does memory: a restart rolls the claim back, and the
			// kubelet's retry takes every step again (each is idempotent)
			// and writes the mark. Memory saying prepared would answer the
			// retry from a record a restart does not know.
			started := rec
			started.Phase = checkpoint.PrepareStarted
			m.mu.Lock()
			m.data.Claims[string(uid)] = started
			m.changed()
			m.mu.Unlock()
			return err
		}
		return nil
	})
	if lost {
		m.abandon(ctx, uid, rec, settled)
	}
	if err != nil {
		return nil, fmt.Errorf("claim %s: %w", ref, err)
	}
	failpoint(fpPrepareCompleted)
	return results(prepared), nil
}

// started is where a prepare starts from: the claim's record (its started
// mark, or its completed one if done), and the devices of the earlier
// attempt it takes over, if any.
type started struct {
	rec     checkpoint.Claim
	done    bool
	earlier []checkpoint.Device
}

// markStarted records the claim's started mark over its record c (ok: one
// exists), or finds it prepared; m.mu held on entry, released before it
// returns.
func (m *Manager) markStarted(claim *resourceapi.ResourceClaim, want []checkpoint.Device, mps *mpsPlan, c checkpoint.Claim, ok bool) (st started, err error) {
	uid := claim.UID
	if ok && c.Phase == checkpoint.PrepareCompleted {
		m.mu.Unlock()
		if !sameDevices(c.Devices, want) {
			return st, fmt.Errorf("already prepared with devices %s, now allocated %s; unprepare it first", names(c.Devices), names(want))
		}
		return started{rec: c, done: true}, nil
	}
	if mps != nil && (m.cfg.MPS == nil || !m.cfg.MPS.Runs()) {
		// Checked here, not before: a claim prepared while MPS ran is
		// still found prepared (the kubelet asks again).
		m.mu.Unlock()
		return st, errors.New("sharing strategy MPS is not available: the plugin runs without an MPS daemon image (--mps-image); ask the operator to set it, or use TimeSlicing")
	}
	// A started mark is an earlier attempt whose completed mark was
	// not written (in this process, or by the other instance of a
	// rolling update): what it made is still there, and this attempt
	// takes it over.
	if ok && c.Phase == checkpoint.PrepareStarted {
		st.earlier = c.Devices
	}
	if err := m.reserve(uid, want); err != nil {
		m.mu.Unlock()
		return st, err
	}
	r := checkpoint.Claim{Namespace: claim.Namespace, Name: claim.Name, Phase: checkpoint.PrepareStarted, Devices: want}
	if mps != nil {
		loc := m.cfg.MPS.Locate(string(uid))
		r.MPS = &loc
	}
	m.data.Claims[string(uid)] = r
	st.rec = r
	v := m.changed()
	m.mu.Unlock()
	// The mark must be on disk before work a restart would have to
	// undo from the checkpoint alone. A CDI spec is not such work: a
	// restart removes specs no checkpointed claim owns. In a rolling
	// update the mark on disk is also what tells the other instance
	// that the devices are taken.
	if undoable(r) || m.cfg.Shared != nil {
		if err := m.persist(v); err != nil {
			// Memory goes back to what is on disk: the earlier
			// attempt's record, if any, stays, with what it made.
			m.mu.Lock()
			m.release(uid, want)
			if ok {
				m.data.Claims[string(uid)] = c
				m.hold(uid, c.Devices)
			} else {
				delete(m.data.Claims, string(uid))
			}
			m.changed()
			m.mu.Unlock()
			return st, err
		}
	}
	return st, nil
}

// Unprepare releases a claim's devices. Unknown claims succeed.
func (m *Manager) Unprepare(ctx context.Context, uid types.UID) error {
	_, err := m.unprepare(ctx, uid, nil)
	return err
}

// UnprepareStale unprepares a claim the stale-claim sweep found gone from the
// API server, if it is still recorded as seen when the sweep read the
// record: the sweep asks the API server outside every lock, and a claim
// changed meanwhile is checked again at the next sweep (false).
func (m *Manager) UnprepareStale(ctx context.Context, uid types.UID, seen checkpoint.Claim) (bool, error) {
	return m.unprepare(ctx, uid, func(c checkpoint.Claim) bool {
		return c.Phase == seen.Phase && sameDevices(c.Devices, seen.Devices)
	})
}

// unprepare releases a claim's devices if its record passes still (nil:
// any record, and an unknown claim succeeds); false when it did not.
func (m *Manager) unprepare(ctx context.Context, uid types.UID, still func(checkpoint.Claim) bool) (bool, error) {
	unlock, err := m.lockClaim(uid)
	if err != nil {
		return false, fmt.Errorf("claim %s: %w", uid, err)
	}
	defer unlock()
	return m.unprepareHeld(ctx, uid, still)
}

// unprepareHeld is unprepare with the claim's lock held.
func (m *Manager) unprepareHeld(ctx context.Context, uid types.UID, still func(checkpoint.Claim) bool) (bool, error) {
	var c checkpoint.Claim
	var known, skip, gone bool
	var err error
	err = m.locked(ctx, func() error {
		m.mu.Lock()
		c, known = m.data.Claims[string(uid)]
		if !known || (still != nil && !still(c)) {
			m.mu.Unlock()
			skip = true
			return nil
		}
		if !undoable(c) && c.Phase != checkpoint.UnprepareStarted {
			// Nothing to undo but the CDI spec, which a restart removes
			// once no claim owns it: the record goes at once, in the one
			// checkpoint write the unprepare needs, and the spec after.
			m.release(uid, c.Devices)
			delete(m.data.Claims, string(uid))
			v := m.changed()
			m.mu.Unlock()
			gone = true
			return m.persist(v)
		}
		c.Phase = checkpoint.UnprepareStarted
		m.data.Claims[string(uid)] = c
		v := m.changed()
		m.mu.Unlock()
		return m.persist(v)
	})
	switch {
	case err != nil && known:
		return false, fmt.Errorf("claim %s: %w", claimRef(c.Namespace, c.Name), err)
	case err != nil:
		return false, fmt.Errorf("claim %s: %w", uid, err)
	case skip && (known || still != nil):
		return false, nil
	case skip:
		// Nothing recorded; a spec could still be left by a lost checkpoint.
		return true, m.removeSpecs(string(uid))
	case gone:
		failpoint(fpUnprepareCompleted)
		if err := m.removeSpecs(string(uid)); err != nil {
			return false, fmt.Errorf("claim %s: %w", claimRef(c.Namespace, c.Name), err)
		}
		if err := m.forget(c, uid); err != nil {
			return false, err
		}
		klog.FromContext(ctx).V(2).Info("Claim unprepared", "claim", claimRef(c.Namespace, c.Name), "uid", uid)
		return true, nil
	}
	failpoint(fpUnprepareStarted)

	// Outside the node lock: the UnprepareStarted record holds the devices
	// until the claim leaves the checkpoint.
	if err := m.removeSpecs(string(uid)); err != nil {
		return false, fmt.Errorf("claim %s: %w", claimRef(c.Namespace, c.Name), err)
	}
	failpoint(fpCDIRemove)
	if err := m.forget(c, uid); err != nil {
		return false, err
	}
	if err := m.stopDaemons(ctx, c); err != nil {
		return false, fmt.Errorf("claim %s: %w", claimRef(c.Namespace, c.Name), err)
	}
	if err := m.destroyPartitions(ctx, c.Devices); err != nil {
		return false, fmt.Errorf("claim %s: %w", claimRef(c.Namespace, c.Name), err)
	}
	// The claim is being unprepared, so it no longer counts: its GPUs go
	// back to their original settings unless another claim needs them.
	if err := m.reconcileGPUs(ctx, settingsGPUs(c.Devices)); err != nil {
		return false, fmt.Errorf("claim %s: restore GPU settings: %w", claimRef(c.Namespace, c.Name), err)
	}

	err = m.locked(ctx, func() error {
		m.mu.Lock()
		m.release(uid, c.Devices)
		delete(m.data.Claims, string(uid))
		v := m.changed()
		m.mu.Unlock()
		return m.persist(v)
	})
	if err != nil {
		return false, fmt.Errorf("claim %s: %w", claimRef(c.Namespace, c.Name), err)
	}
	failpoint(fpUnprepareCompleted)
	klog.FromContext(ctx).V(2).Info("Claim unprepared", "claim", claimRef(c.Namespace, c.Name), "uid", uid)
	return true, nil
}

// forget removes what Config.Forget keeps for a claim besides its specs.
func (m *Manager) forget(c checkpoint.Claim, uid types.UID) error {
	if m.cfg.Forget == nil {
		return nil
	}
	if err := m.cfg.Forget(c.Namespace, c.Name, uid); err != nil {
		return fmt.Errorf("claim %s: %w", claimRef(c.Namespace, c.Name), err)
	}
	return nil
}

// StopOrphanDaemon stops the MPS daemon the daemon sweep found for a claim
// this node does not hold, unless the claim holds one by the time its lock
// is taken (false): the sweep lists daemons outside every lock.
func (m *Manager) StopOrphanDaemon(ctx context.Context, claimUID string) (bool, error) {
	if m.cfg.MPS == nil {
		return false, nil
	}
	return m.stopOrphan(ctx, claimUID, "MPS daemon", func(c checkpoint.Claim) bool { return c.MPS != nil }, func() error {
		return m.cfg.MPS.Stop(ctx, m.cfg.MPS.Locate(claimUID))
	})
}

// StopOrphanIMEX is StopOrphanDaemon for IMEX daemons.
func (m *Manager) StopOrphanIMEX(ctx context.Context, claimUID string) (bool, error) {
	if m.cfg.IMEX == nil {
		return false, nil
	}
	return m.stopOrphan(ctx, claimUID, "IMEX daemon", func(c checkpoint.Claim) bool { return c.IMEX != nil || c.Domain }, func() error {
		return m.cfg.IMEX.Stop(ctx, m.cfg.IMEX.Locate(claimUID))
	})
}

// stopOrphan runs stop under the claim's lock unless the claim's record
// holds the daemon (holds).
func (m *Manager) stopOrphan(ctx context.Context, claimUID, what string, holds func(checkpoint.Claim) bool, stop func() error) (bool, error) {
	unlock, err := m.lockClaim(types.UID(claimUID))
	if err != nil {
		return false, fmt.Errorf("claim %s: %w", claimUID, err)
	}
	defer unlock()
	var held bool
	err = m.locked(ctx, func() error {
		m.mu.Lock()
		c, ok := m.data.Claims[claimUID]
		m.mu.Unlock()
		held = ok && holds(c)
		return nil
	})
	if err != nil || held {
		return false, err
	}
	klog.FromContext(ctx).Info("Deleting a daemon no prepared claim owns", "daemon", what, "claimUID", claimUID)
	if err := stop(); err != nil {
		return false, fmt.Errorf("claim %s: %s: %w", claimUID, what, err)
	}
	return true, nil
}

// undoable reports whether preparing the claim changes the node in ways only
// its checkpoint record can undo after a crash: MIG partitions, GPU settings,
// an MPS or IMEX daemon.
func undoable(c checkpoint.Claim) bool {
	if c.MPS != nil || c.IMEX != nil {
		return true
	}
	for _, d := range c.Devices {
		if d.MIG != nil || d.Settings != nil {
			return true
		}
	}
	return false
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
		d, ok := m.inventory().Lookup(r.Device)
		if !ok {
			return nil, fmt.Errorf("allocated device %s does not exist on node %s; it may have been published by an earlier configuration of the plugin: delete the claim to have it allocated again", r.Device, m.cfg.PoolName)
		}
		admin := r.AdminAccess != nil && *r.AdminAccess
		dev := checkpoint.Device{
			Requests:    []string{r.Request},
			Pool:        r.Pool,
			Device:      r.Device,
			AdminAccess: admin,
		}
		if !admin {
			// Admin access observes: it never creates the partition, so it
			// records none, and nothing can destroy one on its behalf.
			dev.MIG = migRecord(d)
		}
		if r.ShareID != nil {
			if !d.Share.Shared() {
				return nil, fmt.Errorf("allocated a share (%s) of device %s, which this node does not share between claims; delete the claim to have it allocated again", *r.ShareID, r.Device)
			}
			dev.ShareID = string(*r.ShareID)
			if q, ok := r.ConsumedCapacity[published.CapMemory]; ok {
				dev.MemoryBytes = q.Value()
			}
		} else if d.Share.Shared() {
			return nil, fmt.Errorf("device %s is shared between claims on this node but was allocated without a share ID; delete the claim to have it allocated again", r.Device)
		}
		out = append(out, dev)
	}
	return out, nil
}

// reserve takes ownership of the claim's devices: exclusive, or a share of
// a device claims share; m.mu held.
func (m *Manager) reserve(uid types.UID, devs []checkpoint.Device) error {
	if err := m.conflictLocked(uid, devs); err != nil {
		return err
	}
	for _, d := range devs {
		if d.AdminAccess {
			continue
		}
		if err := m.checkShareLocked(uid, d); err != nil {
			return err
		}
		if d.ShareID != "" {
			continue
		}
		if holder, ok := m.owners[d.Device]; ok && holder != uid {
			h := m.data.Claims[string(holder)]
			return fmt.Errorf("device %s is already prepared for claim %s (%s); unprepare it first", d.Device, claimRef(h.Namespace, h.Name), holder)
		}
		want, _ := m.inventory().Lookup(d.Device)
		for held, holder := range m.owners {
			if holder == uid {
				continue
			}
			if m.overlapsHeld(want, held, holder) {
				c := m.data.Claims[string(holder)]
				return fmt.Errorf("device %s shares GPU %s with device %s, already prepared for claim %s (%s); unprepare it first", d.Device, want.GPU.Name(), held, claimRef(c.Namespace, c.Name), holder)
			}
		}
	}
	m.hold(uid, devs)
	return nil
}

// hold records uid as the exclusive holder of its devices that no other
// claim may use at once; m.mu held.
func (m *Manager) hold(uid types.UID, devs []checkpoint.Device) {
	for _, d := range devs {
		if !d.AdminAccess && d.ShareID == "" {
			m.owners[d.Device] = uid
		}
	}
}

// overlapsHeld says whether want uses hardware of device held (prepared for
// holder). A held partition the inventory no longer lists (after a fallback
// from dynamic MIG) is located by its checkpointed record; m.mu held.
func (m *Manager) overlapsHeld(want inventory.Device, held string, holder types.UID) bool {
	if h, ok := m.inventory().Lookup(held); ok {
		return inventory.Overlap(want, h)
	}
	for _, d := range m.data.Claims[string(holder)].Devices {
		if d.Device != held || d.MIG == nil || d.MIG.GPUUUID != want.GPU.UUID {
			continue
		}
		rec := inventory.Device{Name: held, Kind: inventory.Partition, GPU: want.GPU, Placement: mig.Placement{Start: d.MIG.Start, Size: d.MIG.Size}}
		return inventory.Overlap(want, rec)
	}
	return false
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
func (m *Manager) rollback(ctx context.Context, uid types.UID, rec checkpoint.Claim) {
	logger := klog.FromContext(ctx)
	if err := m.cfg.CDI.Remove(string(uid)); err != nil {
		logger.Error(err, "Rolling back a failed prepare: CDI spec left behind; it is removed at the next start", "uid", uid)
	} else if err := m.cfg.HostNodes.Release(ctx, string(uid)); err != nil {
		logger.Error(err, "Rolling back a failed prepare: device nodes left behind; they are removed at the next start", "uid", uid)
	}
	if err := m.stopMPS(ctx, rec); err != nil {
		logger.Error(err, "Rolling back a failed prepare: MPS daemon left behind; it is removed at the next start", "uid", uid)
	}
	err := m.locked(ctx, func() error {
		m.mu.Lock()
		m.release(uid, rec.Devices)
		delete(m.data.Claims, string(uid))
		m.changed()
		m.mu.Unlock()
		if err := m.reconcileHeld(ctx, settingsGPUs(rec.Devices)); err != nil {
			logger.Error(err, "Rolling back a failed prepare: GPU settings not restored; the next start restores them", "uid", uid)
		}
		m.mu.Lock()
		v := m.changed()
		m.mu.Unlock()
		return m.persist(v)
	})
	if err != nil {
		logger.Error(err, "Rolling back a failed prepare: checkpoint not updated; the next start rolls it back", "uid", uid)
	}
}

// abandon undoes what an attempt whose started mark the other instance
// settled made (rec: the devices as prepared, with the partitions' UUIDs).
// With no record left (rolled back, or lost in a rebuild), nothing else
// holds them: its partitions (destroyed by UUID, so only the instances this
// attempt made), CDI spec and MPS daemon go, as in a rollback. With a record
// of another attempt (settled set), they are that attempt's now and stay.
func (m *Manager) abandon(ctx context.Context, uid types.UID, rec checkpoint.Claim, settled bool) {
	logger := klog.FromContext(ctx)
	if settled {
		logger.Info("Leaving a prepare another attempt took over", "claim", klog.KRef(rec.Namespace, rec.Name), "uid", uid)
		return
	}
	logger.Info("Undoing a prepare the other plugin instance rolled back meanwhile", "claim", klog.KRef(rec.Namespace, rec.Name), "uid", uid)
	if err := m.destroyPartitions(ctx, rec.Devices); err != nil {
		logger.Error(err, "Undoing a prepare rolled back meanwhile: MIG partition left behind; it is logged as foreign at the next start", "uid", uid)
	}
	m.rollback(ctx, uid, rec)
}

// materialize creates the claim's MIG partitions and writes its CDI spec,
// returning the devices with their CDI IDs. On error it undoes what it did.
// Every step may find itself done by an earlier attempt (earlier: its
// devices, from the claim's started mark) and is idempotent: settings
// already applied stay, partitions in place are adopted (createPartition),
// a running MPS daemon is found running, the CDI spec is rewritten.
func (m *Manager) materialize(ctx context.Context, claim *resourceapi.ResourceClaim, devs []checkpoint.Device, mps *mpsPlan, daemon *checkpoint.MPSDaemon, earlier []checkpoint.Device) (_ []checkpoint.Device, err error) {
	out := make([]checkpoint.Device, len(devs))
	for i, d := range devs {
		if d.MIG != nil {
			rec := *d.MIG
			d.MIG = &rec
		}
		out[i] = d
	}
	defer func() {
		// out, not the result: an error return clears the result. Only
		// partitions this call created or adopted (their record has the
		// instance's UUID) are destroyed: one found occupied may be
		// another's.
		if err != nil {
			var created []checkpoint.Device
			for _, d := range out {
				if d.MIG != nil && d.MIG.UUID != "" {
					created = append(created, d)
				}
			}
			_ = m.destroyPartitions(ctx, created)
		}
	}()
	if err := m.reconcileGPUs(ctx, settingsGPUs(out)); err != nil {
		return nil, err
	}
	spec := cdi.ClaimSpec{ClaimUID: string(claim.UID), ClaimNamespace: claim.Namespace, ClaimName: claim.Name, BootID: m.cfg.BootID}
	var visible []string
	uuids := make([]string, len(out))
	seen := map[string]bool{}
	var served []inventory.Device // what the driver files are chosen for
	for i := range out {
		d := &out[i]
		if seen[d.Device] {
			continue // one device may serve several requests
		}
		seen[d.Device] = true
		inv, ok := m.inventory().Lookup(d.Device)
		if !ok {
			return nil, fmt.Errorf("device %s is no longer published on this node", d.Device)
		}
		served = append(served, inv)
		record := func() error { return m.recordPartitions(ctx, claim.UID, out) }
		dev, uuid, err := m.containerDevice(inv, d, earlierPartition(earlier, *d), record)
		if err != nil {
			return nil, fmt.Errorf("device %s: %w", d.Device, err)
		}
		if d.MemoryBytes > 0 {
			// The scheduler guarantees the shares fit; frameworks read
			// the limit to stay within theirs.
			dev.Env = append(dev.Env, memoryEnv(d.Device)+"="+fmt.Sprint(d.MemoryBytes>>20))
		}
		uuids[i] = uuid
		visible = append(visible, uuid)
		spec.Devices = append(spec.Devices, dev)
	}
	if len(spec.Devices) == 0 {
		return out, nil
	}
	env := []string{"NVIDIA_VISIBLE_DEVICES=" + strings.Join(visible, ",")}
	if m.cfg.ClaimEnv != nil {
		extra, err := m.cfg.ClaimEnv(claim)
		if err != nil {
			return nil, err
		}
		env = append(env, extra...)
	}
	driver, err := m.driverEdits(claim, served)
	if err != nil {
		return nil, err
	}
	spec.Common = cdi.Edits{
		DeviceNodes: append(m.cfg.DevNodes.Control(), driver.DeviceNodes...),
		Env:         env,
		Mounts:      driver.Mounts,
		Hooks:       driver.Hooks,
	}
	if mps != nil {
		d := MPSDaemon{MPSDaemon: *daemon, ClaimUID: string(claim.UID), ClaimNamespace: claim.Namespace, ClaimName: claim.Name}
		for _, i := range mps.devices {
			d.Devices = append(d.Devices, uuids[i])
		}
		d.Env = mps.env(len(d.Devices))
		edits, err := m.cfg.MPS.Start(ctx, d)
		if err != nil {
			return nil, fmt.Errorf("start MPS control daemon: %w", err)
		}
		failpoint(fpMPSStart)
		spec.Common.Env = append(spec.Common.Env, edits.Env...)
		spec.Common.Mounts = append(spec.Common.Mounts, edits.Mounts...)
	}
	// The spec keeps the claim's record, to rebuild a lost checkpoint from.
	if spec.Record, err = m.specRecord(claim, out, daemon); err != nil {
		return nil, err
	}
	ids, err := m.cfg.CDI.Write(spec)
	if err != nil {
		return nil, err
	}
	failpoint(fpCDIWrite)
	if err := m.ensureHostNodes(ctx, claim.UID, spec); err != nil {
		return nil, err
	}
	for i := range out {
		out[i].CDIDeviceIDs = []string{ids[out[i].Device]}
	}
	return out, nil
}

// containerDevice makes the device usable (creating a MIG partition, or
// taking a switchable GPU out of MIG mode for whole use) and returns what
// the container needs for it and the UUID it is known by.
func (m *Manager) containerDevice(inv inventory.Device, d *checkpoint.Device, earlier *checkpoint.MIGPartition, record func() error) (cdi.Device, string, error) {
	g := inv.GPU
	parent := m.cfg.DevNodes.GPU(g.Minor)
	envKey := uuidEnv(d.Device)
	switch inv.Kind {
	case inventory.Whole:
		if inv.Counters != "" && g.MIGSwitchable && !d.AdminAccess {
			if err := m.cfg.MIG.ExitMIG(g.UUID); err != nil {
				return cdi.Device{}, "", fmt.Errorf("use the whole GPU: %w", err)
			}
		}
		return cdi.Device{Name: d.Device, DeviceNodes: []cdi.DeviceNode{parent}, Env: []string{envKey + "=" + g.UUID}}, g.UUID, nil
	case inventory.Partition:
		if d.AdminAccess {
			return m.observePartition(inv, d)
		}
		if err := m.createPartition(d.MIG, earlier, record); err != nil {
			return cdi.Device{}, "", err
		}
		caps, err := m.cfg.DevNodes.MIG(g.Minor, d.MIG.GPUInstance, d.MIG.ComputeInstance)
		if err != nil {
			return cdi.Device{}, "", err
		}
		return cdi.Device{Name: d.Device, DeviceNodes: append([]cdi.DeviceNode{parent}, caps...), Env: []string{envKey + "=" + d.MIG.UUID}}, d.MIG.UUID, nil
	default: // a MIG device an operator made
		in := inv.Instance
		caps, err := m.cfg.DevNodes.MIG(g.Minor, in.GPUInstanceID, in.ComputeInstanceID)
		if err != nil {
			return cdi.Device{}, "", err
		}
		return cdi.Device{Name: d.Device, DeviceNodes: append([]cdi.DeviceNode{parent}, caps...), Env: []string{envKey + "=" + in.UUID}}, in.UUID, nil
	}
}

// observePartition gives an admin-access claim the partition as it is now:
// its capability nodes if it exists (another claim holds it), else only its
// parent GPU. Nothing is created.
func (m *Manager) observePartition(inv inventory.Device, d *checkpoint.Device) (cdi.Device, string, error) {
	g := inv.GPU
	parent := m.cfg.DevNodes.GPU(g.Minor)
	envKey := uuidEnv(d.Device)
	if m.cfg.MIG == nil {
		return cdi.Device{}, "", fmt.Errorf("MIG partitions are not managed on this node")
	}
	insts, err := m.cfg.MIG.Instances(g.UUID)
	if err != nil {
		return cdi.Device{}, "", fmt.Errorf("admin access: list MIG instances: %w", err)
	}
	for _, in := range insts {
		if in.ProfileIndex != inv.Profile.Index || in.Placement.Start != inv.Placement.Start || in.UUID == "" {
			continue
		}
		caps, err := m.cfg.DevNodes.MIG(g.Minor, in.GPUInstanceID, in.ComputeInstanceID)
		if err != nil {
			return cdi.Device{}, "", err
		}
		return cdi.Device{Name: d.Device, DeviceNodes: append([]cdi.DeviceNode{parent}, caps...), Env: []string{envKey + "=" + in.UUID}}, in.UUID, nil
	}
	return cdi.Device{Name: d.Device, DeviceNodes: []cdi.DeviceNode{parent}, Env: []string{envKey + "=" + g.UUID}}, g.UUID, nil
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

// deviceEnv is the prefix of a device's own environment variables:
// TESSERA_GPU_0 for gpu-0.
func deviceEnv(device string) string {
	return "TESSERA_" + strings.ToUpper(strings.ReplaceAll(device, "-", "_"))
}

// uuidEnv names the variable holding a device's UUID (a MIG device's for a
// partition): TESSERA_GPU_0_MIG_1G10GB_6_UUID.
func uuidEnv(device string) string { return deviceEnv(device) + "_UUID" }

// memoryEnv names the variable holding a shared device's memory limit in
// MiB: TESSERA_GPU_0_MEMORY_LIMIT_MIB.
func memoryEnv(device string) string { return deviceEnv(device) + "_MEMORY_LIMIT_MIB" }

// checkShareLocked refuses to mix exclusive and shared use of one device,
// and shares beyond the device's memory: the scheduler's accounting, checked
// again as the last line of defence; m.mu held.
func (m *Manager) checkShareLocked(uid types.UID, d checkpoint.Device) error {
	inv, _ := m.inventory().Lookup(d.Device)
	used := d.MemoryBytes
	for other, c := range m.data.Claims {
		if types.UID(other) == uid {
			continue
		}
		for _, o := range c.Devices {
			if o.Device != d.Device || o.AdminAccess {
				continue
			}
			if (o.ShareID == "") != (d.ShareID == "") {
				return fmt.Errorf("device %s is held by claim %s (%s) and cannot be both shared and exclusive; unprepare it first", d.Device, claimRef(c.Namespace, c.Name), other)
			}
			used += o.MemoryBytes
		}
	}
	if d.ShareID != "" && inv.GPU.MemoryBytes > 0 && used > inv.GPU.MemoryBytes {
		return fmt.Errorf("device %s: memory shares would add up to %d MiB, more than the GPU's %d MiB; the claim was allocated past the GPU's capacity, delete it to have it allocated again", d.Device, used>>20, inv.GPU.MemoryBytes>>20)
	}
	return nil
}
