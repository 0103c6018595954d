package prepare

import (
	"context"
	"fmt"

	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"

	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/inventory"
	"github.com/tessera-dev/tessera/driver/mig"
)

// migRecord is what the checkpoint keeps of a device's partition, before
// the partition exists.
func migRecord(d inventory.Device) *checkpoint.MIGPartition {
	if d.Kind != inventory.Partition {
		return nil
	}
	return &checkpoint.MIGPartition{
		GPUUUID: d.GPU.UUID, ProfileIndex: d.Profile.Index, Start: d.Placement.Start, Size: d.Placement.Size,
		Switchable: d.GPU.MIGSwitchable,
	}
}

// createPartition makes a device's partition and records its identity, on
// disk through record before anything else happens: the identity (the MIG
// device's UUID) is what lets a rollback or a restart destroy the partition
// and nothing else at its placement. The partition an earlier attempt of the
// claim's prepare made (earlier: that attempt's record of it, nil if none)
// is adopted instead: recreated, it would be found occupied.
func (m *Manager) createPartition(rec, earlier *checkpoint.MIGPartition, record func() error) error {
	if m.cfg.MIG == nil {
		return fmt.Errorf("MIG partitions are not managed on this node")
	}
	if earlier != nil {
		if adopted, err := m.adoptPartition(rec, earlier); err != nil || adopted {
			return err
		}
	}
	inst, err := m.cfg.MIG.Create(rec.GPUUUID, rec.Switchable, rec.ProfileIndex, mig.Placement{Start: rec.Start, Size: rec.Size})
	if err != nil {
		return err
	}
	rec.GPUInstance, rec.ComputeInstance, rec.UUID = inst.GPUInstanceID, inst.ComputeInstanceID, inst.UUID
	if err := record(); err != nil {
		return fmt.Errorf("record the MIG partition just created: %w", err)
	}
	failpoint(fpMIGCreate)
	return nil
}

// adoptPartition takes over the instance at rec's placement, of rec's
// profile, that the claim's earlier record names (by UUID too, when the
// attempt recorded it). Only the claim's record names that placement:
// reserve refuses a device overlapping another claim's. A GPU instance
// left without its compute instance (an attempt that died inside Create)
// is destroyed, to be created afresh.
func (m *Manager) adoptPartition(rec, earlier *checkpoint.MIGPartition) (bool, error) {
	insts, err := m.cfg.MIG.Instances(rec.GPUUUID)
	if err != nil {
		return false, fmt.Errorf("list MIG instances: %w", err)
	}
	for _, in := range insts {
		if in.ProfileIndex != rec.ProfileIndex || in.Placement.Start != rec.Start {
			continue
		}
		switch {
		case in.UUID == "":
			// No compute instance: nothing runs in it, it is safe to
			// destroy and create again.
			_, err := m.cfg.MIG.Destroy(rec.GPUUUID, rec.Switchable, rec.ProfileIndex, mig.Placement{Start: rec.Start, Size: rec.Size}, "")
			return false, err
		case in.UUID != earlier.UUID:
			// Not the one the earlier attempt recorded making (or it
			// recorded none): someone else's; Create reports the
			// placement occupied.
			return false, nil
		}
		rec.GPUInstance, rec.ComputeInstance, rec.UUID = in.GPUInstanceID, in.ComputeInstanceID, in.UUID
		return true, nil
	}
	return false, nil
}

// earlierPartition is the partition an earlier attempt recorded for the
// device at the same place, if any.
func earlierPartition(earlier []checkpoint.Device, d checkpoint.Device) *checkpoint.MIGPartition {
	if d.MIG == nil || d.AdminAccess {
		return nil
	}
	for _, e := range earlier {
		if e.Device == d.Device && e.MIG != nil && e.MIG.GPUUUID == d.MIG.GPUUUID && e.MIG.ProfileIndex == d.MIG.ProfileIndex && e.MIG.Start == d.MIG.Start {
			return e.MIG
		}
	}
	return nil
}

// destroyPartitions removes the partitions recorded for devices: each the
// instance of the recorded UUID, or, for a record without one (its prepare
// stopped before the partition was recorded made), an instance with no
// compute instance at the placement. Any other instance there is left alone
// (with a log line): it was made by someone else, and may be in use. A
// partition that does not exist (never created, already gone) is fine.
func (m *Manager) destroyPartitions(ctx context.Context, devs []checkpoint.Device) error {
	for _, d := range devs {
		if d.MIG == nil {
			continue
		}
		if m.cfg.MIG == nil {
			return fmt.Errorf("device %s has a MIG partition but MIG is not managed on this node", d.Device)
		}
		destroyed, err := m.cfg.MIG.Destroy(d.MIG.GPUUUID, d.MIG.Switchable, d.MIG.ProfileIndex, mig.Placement{Start: d.MIG.Start, Size: d.MIG.Size}, d.MIG.UUID)
		if err != nil {
			return fmt.Errorf("device %s: destroy MIG partition: %w", d.Device, err)
		}
		if !destroyed {
			klog.FromContext(ctx).V(2).Info("No MIG instance of this claim's record at the device's placement; any instance there is someone else's and stays", "device", d.Device, "recordedUUID", d.MIG.UUID)
		}
		failpoint(fpMIGDestroy)
	}
	return nil
}

// reportForeignPartitions logs, at start, every partition on a dynamic-MIG
// GPU that no checkpointed claim records. Tessera destroys only partitions
// it recorded creating (each is written to the checkpoint with its claim's
// PrepareStarted mark before it exists, and rolled back from there); one it
// has no record of was made by an operator or mig-manager, or outlived a
// lost checkpoint, and may be in use: it is left alone, and a claim whose
// device overlaps it is refused at prepare ("occupied") until it is gone.
func (m *Manager) reportForeignPartitions(ctx context.Context, data checkpoint.Data) error {
	if m.cfg.MIG == nil || m.inventory() == nil {
		return nil
	}
	ours := map[string]bool{}
	for _, c := range data.Claims {
		for _, d := range c.Devices {
			if d.MIG != nil {
				ours[partitionKey(d.MIG.GPUUUID, d.MIG.ProfileIndex, d.MIG.Start)] = true
			}
		}
	}
	for _, g := range m.inventory().CounterSets {
		insts, err := m.cfg.MIG.Instances(g.UUID)
		if err != nil {
			return fmt.Errorf("GPU %s: list MIG instances: %w", g.Name(), err)
		}
		for _, in := range insts {
			if ours[partitionKey(g.UUID, in.ProfileIndex, in.Placement.Start)] {
				continue
			}
			klog.FromContext(ctx).Info("Leaving alone a MIG instance Tessera has no record of creating; devices overlapping it are refused at prepare until an operator removes it",
				"gpu", g.Name(), "profile", in.Profile, "placement", in.Placement.Start, "uuid", in.UUID)
		}
	}
	return nil
}

func partitionKey(gpuUUID string, profileIndex, start int) string {
	return fmt.Sprintf("%s/%d/%d", gpuUUID, profileIndex, start)
}

// recordPartitions writes the claim's started record again with its
// devices as they stand (the partitions made so far, with their UUIDs), so
// that from now on a rollback or a restart destroys exactly these instances.
func (m *Manager) recordPartitions(ctx context.Context, uid types.UID, devs []checkpoint.Device) error {
	return m.locked(ctx, func() error {
		m.mu.Lock()
		c, ok := m.data.Claims[string(uid)]
		if !ok || c.Phase != checkpoint.PrepareStarted {
			m.mu.Unlock()
			return fmt.Errorf("the claim's started record is gone")
		}
		c.Devices = make([]checkpoint.Device, len(devs))
		for i, d := range devs {
			if d.MIG != nil {
				rec := *d.MIG
				d.MIG = &rec
			}
			c.Devices[i] = d
		}
		m.data.Claims[string(uid)] = c
		v := m.changed()
		m.mu.Unlock()
		return m.persist(v)
	})
}
