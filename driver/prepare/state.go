// Package prepare is the node's claim state machine: it prepares and
// unprepares ResourceClaims for the devices allocated to this node, records
// every step in the checkpoint, writes CDI specs, and recovers after a crash.
//
// The contract:
//   - Every claim moves PrepareStarted -> PrepareCompleted -> UnprepareStarted
//     -> gone, and each move is checkpointed before the work it announces.
//     The one exception: the PrepareStarted mark of a claim whose prepare
//     only writes a CDI spec (no MIG partition, GPU setting or MPS daemon)
//     is not waited for, as a restart removes specs no claim owns; nor is
//     the UnprepareStarted mark of such a claim: its record leaves the
//     checkpoint at once and its spec after (one checkpoint write), and a
//     crash in between leaves a spec no claim owns.
//     After a crash, PrepareStarted claims are rolled back (their CDI spec
//     removed, their devices released) and the kubelet's retry prepares them
//     afresh; UnprepareStarted claims are finished.
//   - Prepare is idempotent: a prepared claim returns the devices recorded for
//     it. Unprepare of an unknown claim succeeds. A prepare whose completed
//     mark could not be written leaves the claim PrepareStarted in memory as
//     on disk, and its retry (by this process, by the other instance of a
//     rolling update, or after a restart's rollback) takes every step again,
//     each idempotent: settings applied stay, the partition the earlier
//     attempt made at the recorded placement is adopted, the MPS daemon is
//     found running, the CDI spec is rewritten. A record a prepare cannot
//     take over (an unprepare that did not finish, or a started mark of
//     other devices: the claim was allocated again) is never overwritten:
//     the prepare first finishes it as an unprepare would, undoing what it
//     records. A started mark that fails to be written leaves the earlier
//     record as it was, in memory as on disk. The completed mark is written
//     only over the attempt's own started mark: one the other instance of a
//     rolling update settled meanwhile (an earlier release's start rolls
//     back every started claim; a rebuild from the specs knows no claim
//     whose spec is not written yet) fails the prepare, and what it made is
//     undone unless another attempt's record holds it.
//   - A device belongs to at most one claim (admin-access results excepted,
//     which only observe). A claim asking for a device another claim holds is
//     refused, naming the holder: the driver is the last line of defence when
//     the scheduler double-allocates.
//   - A gang domain claim (PrepareDomain, domain.go) holds no device on
//     the node: its CDI spec, of the domain class, and on an NVLink domain
//     the node's IMEX daemon for it (when the plugin runs them). Without a
//     daemon it is recorded PrepareCompleted, without devices, after its
//     spec is written (no started mark, as for any claim that only writes
//     a spec), so that a restart removes a domain spec no checkpointed
//     claim owns, like a GPU claim's, and never one whose claim is
//     prepared. With a daemon, the daemon's location is recorded with a
//     PrepareStarted mark before it is started, like an MPS daemon's, and
//     the claim is unprepared in two steps. A checkpoint that predates
//     these records (Data.DomainClaims unset) adopts the domain specs of
//     this boot instead of removing them (with their daemons' locations
//     whenever the plugin can stop IMEX daemons, even with none running
//     now: stopping a daemon never started succeeds).
//   - Claims never wait for each other except for a shared map update and
//     the checkpoint write, which is batched: concurrent claims share one
//     fsync (group commit). Operations on one claim are serialised by a
//     per-claim lock.
//   - In a rolling update two plugin instances serve the node and share
//     its checkpoint (Config.Shared). Each read or change of the prepared
//     state then runs under the node lock, starting from the checkpoint on
//     disk and writing its change before the lock is released (locked);
//     nothing slow runs under it (no API call, no wait for an MPS daemon, no
//     MIG partition created): the started mark reserves the devices, the
//     slow work follows outside the lock, and the completed mark is written
//     under it again. A claim's whole prepare or unprepare holds its claim
//     lock, shared by both instances. A start's recovery leaves alone the
//     claims (and the specs) whose claim lock the other instance holds:
//     they are under way there, not interrupted. The MPS daemon of an
//     interrupted claim is stopped once its record is gone, outside the
//     node lock; a crash in between leaves a daemon no claim holds, which
//     the daemon sweep deletes.
//   - A corrupted checkpoint, found at start or by a rolling update's
//     reload, is copied aside and rebuilt from the CDI specs of this boot;
//     the rebuilt file replaces it before the node-wide lock is released,
//     and a crash before that finds the corrupted file and rebuilds again.
//     Each spec carries its claim's checkpoint record and the originals of
//     the GPU settings the claim needs (rebuild.go), so the rebuilt file
//     holds every field the lost one held for those claims. A spec of an
//     earlier release is rebuilt from what it shows (a partition with the
//     UUID it gave the container); what it cannot tell is left as it is on
//     the node, never undone: a device several claims' specs name may be
//     an admin-access observer's, so those without a record are rebuilt
//     as observing it.
//   - What is published and prepared is derived from NVML at start; nothing
//     about devices is trusted from the checkpoint except which claim holds
//     which device and where its MIG partition sits.
//   - A MIG partition is recorded (GPU, profile index, placement) with the
//     PrepareStarted mark before it is created, and destroyed before its claim
//     leaves the checkpoint; a crash at any step is rolled back from that
//     record. The partition's MIG device UUID is written to the record as
//     soon as the partition exists, and every destroy by record matches it
//     (a record without one destroys only an instance with no compute
//     instance, where nothing can run). Tessera destroys only partitions it
//     recorded: at start, a
//     partition no checkpointed claim records (an operator's, mig-manager's,
//     or one that outlived a lost checkpoint) is logged and left alone, never
//     destroyed, since a running workload may be using it.
//   - Admin-access results observe a device and never change it: they create
//     no partition, destroy none, and touch no GPU setting.
//   - Named failure points (failpoint_names.go), armed only in builds with
//     the faultinject tag, let tests kill a prepare, an unprepare or a
//     reload's rebuild after each step that changes the node (MIG
//     partition, GPU setting, MPS or IMEX daemon, CDI spec, checkpoint) and
//     check that a restart converges.
package prepare

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"

	"github.com/tessera-dev/tessera/cdi"
	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/devnodes"
	"github.com/tessera-dev/tessera/driver/hostnodes"
	"github.com/tessera-dev/tessera/driver/inventory"
	"github.com/tessera-dev/tessera/driver/mig"
)

// Config is what the state machine needs from the node.
type Config struct {
	// DriverName and PoolName select this node's allocation results.
	DriverName string
	PoolName   string
	// Inventory is what the node publishes; prepare resolves names in it.
	Inventory *inventory.Inventory
	// MIG creates and destroys partitions; needed when the inventory has
	// partitions.
	MIG Partitioner
	CDI *cdi.Store
	// DomainCDI holds the gang domain claims' specs (driver/domain), which
	// PrepareDomain records; nil when the node prepares none.
	DomainCDI  *cdi.Store
	Checkpoint *checkpoint.Store
	DevNodes   *devnodes.Resolver
	// DriverFiles are the driver's libraries and tools, mounted into every
	// container that gets a GPU.
	DriverFiles cdi.Edits
	// DriverEdits, if set, gives each claim the driver files (and hook)
	// for what its devices can do, instead of DriverFiles
	// (driverfiles.go).
	DriverEdits DriverEdits
	// HostNodes makes on the host the device nodes the driver makes only
	// on demand (MIG capability nodes) once a claim's spec is written, and
	// removes them with the spec; nil makes none (hostnodes.go).
	HostNodes *hostnodes.Nodes
	// BootID is the current boot's ID.
	BootID string
	// Settings changes GPU settings claims need (compute mode, power
	// limit); nil refuses claims that need any.
	Settings GPUSettings
	// MPS runs MPS control daemons; nil, or one that does not run them,
	// refuses claims asking for MPS. Set it whenever daemons may have
	// run: it stops them at unprepare even when it starts none.
	MPS MPSDaemons
	// IMEX runs the IMEX daemons of gang domain claims on NVLink domains;
	// nil, or one that does not run them, runs none (the node's operator
	// runs IMEX). Like MPS, set it to stop what ran before.
	IMEX IMEXDaemons
	// ClaimEnv, if set, adds environment for every container given the
	// claim (the gang controller's rank and size, read from the claim's
	// annotations). An error fails the prepare.
	ClaimEnv func(*resourceapi.ResourceClaim) ([]string, error)
	// Forget, if set, removes what else the node keeps for a claim once its
	// CDI specs are removed (the device metadata files, driver/devicemeta):
	// under the claim's lock, so a prepare of the claim again cannot lose
	// what it writes. An error fails the unprepare, which is retried.
	Forget func(namespace, name string, uid types.UID) error
	// Shared, set in a rolling update, are the locks of the state another
	// plugin instance shares (driver/nodelock); nil when this one owns it.
	Shared SharedLocks
}

// SharedLocks serialise two plugin instances serving one node side by side
// (driver/nodelock).
type SharedLocks interface {
	// LockNode is held around every read and change of the prepared state
	// (locked): never across an API call or a wait.
	LockNode() (unlock func(), err error)
	// LockClaim is held for a claim's whole prepare or unprepare.
	LockClaim(uid types.UID) (unlock func(), err error)
	// TryLockClaim takes a claim's lock unless the other instance holds it
	// (ok false).
	TryLockClaim(uid types.UID) (unlock func(), ok bool, err error)
}

// Partitioner creates and destroys MIG partitions (mig.Manager).
type Partitioner interface {
	Create(gpuUUID string, switchable bool, index int, pl mig.Placement) (mig.Instance, error)
	Destroy(gpuUUID string, switchable bool, index int, pl mig.Placement, uuid string) (bool, error)
	ExitMIG(gpuUUID string) error
	Instances(gpuUUID string) ([]mig.Instance, error)
}

// Manager prepares and unprepares claims.
type Manager struct {
	cfg Config
	// inv is what the node publishes now; it changes when the plugin falls
	// back from dynamic MIG (SetInventory).
	inv atomic.Pointer[inventory.Inventory]

	claimLocks keyedMutex
	// gpuLocks serialise changes of one GPU's settings.
	gpuLocks keyedMutex

	mu      sync.Mutex // guards data, owners and version; never held across I/O
	data    checkpoint.Data
	owners  map[string]types.UID // device name -> exclusive holder
	version uint64               // bumped by every change of data

	fileMu  sync.Mutex // serialises checkpoint writes
	written uint64     // the newest version on disk

	// In a rolling update, the sections waiting for the node lock and
	// whether one of their callers leads (locked); inBatch is set while
	// the leader runs a batch.
	batchMu sync.Mutex
	pending []*section
	leading bool
	inBatch atomic.Bool
	// sections counts the callers of locked not yet returned.
	sections atomic.Int32
}

// New loads the checkpoint and brings the node to a consistent state (see
// recover), under the node lock in a rolling update; the MPS daemons of the
// claims it rolled back or finished are stopped after that lock is released.
func New(ctx context.Context, cfg Config) (*Manager, error) {
	m := &Manager{cfg: cfg, owners: map[string]types.UID{}}
	m.inv.Store(cfg.Inventory)
	unlockNode := func() {}
	if cfg.Shared != nil {
		var err error
		if unlockNode, err = cfg.Shared.LockNode(); err != nil {
			return nil, err
		}
	}
	var r recovered
	defer r.release()
	err := m.recover(ctx, &r)
	unlockNode()
	if err != nil {
		return nil, err
	}
	for _, c := range r.daemons {
		if err := m.stopDaemons(ctx, c); err != nil {
			// Not fatal: the daemon sweep finds it once the API answers.
			klog.FromContext(ctx).Error(err, "Daemon of an interrupted claim not stopped", "claim", klog.KRef(c.Namespace, c.Name))
		}
	}
	return m, nil
}

// recovered is what recover leaves to do once the node lock is released:
// the claims whose MPS daemons to stop, and their claim locks to release
// after.
type recovered struct {
	daemons  []checkpoint.Claim
	releases []func()
}

func (r *recovered) release() {
	for _, f := range r.releases {
		f()
	}
}

// settleable takes the lock of a claim whose leftovers recovery would undo
// or remove, keeping it in r until New is done. In a rolling update a claim
// whose lock the other instance holds is under way there, not interrupted:
// false, and it is left alone.
func (m *Manager) settleable(ctx context.Context, uid string, r *recovered) (bool, error) {
	if m.cfg.Shared == nil {
		return true, nil
	}
	unlock, ok, err := m.cfg.Shared.TryLockClaim(types.UID(uid))
	if err != nil {
		return false, err
	}
	if !ok {
		klog.FromContext(ctx).Info("Leaving a claim the other plugin instance is preparing or unpreparing", "uid", uid)
		return false, nil
	}
	r.releases = append(r.releases, unlock)
	return true, nil
}

// recover loads the checkpoint and settles whatever a crash left half done;
// the node lock is held (in a rolling update).
func (m *Manager) recover(ctx context.Context, r *recovered) error {
	logger := klog.FromContext(ctx)
	data, _, err := m.loadOrRebuild(ctx)
	if err != nil {
		return err
	}
	if data.BootID != "" && data.BootID != m.cfg.BootID {
		logger.Info("Node rebooted since the checkpoint was written; discarding stale prepared claims", "claims", len(data.Claims), "oldBootID", data.BootID, "bootID", m.cfg.BootID)
		for uid := range data.Claims {
			if err := m.removeSpecs(uid); err != nil {
				return err
			}
		}
		data.Claims = map[string]checkpoint.Claim{}
	}
	data.BootID = m.cfg.BootID
	if !data.DomainClaims {
		// Written before domain claims were recorded: keep their specs.
		m.recordDomainSpecs(ctx, &data)
	}
	for uid, c := range data.Claims {
		if c.Phase != checkpoint.PrepareStarted && c.Phase != checkpoint.UnprepareStarted {
			continue
		}
		if ok, err := m.settleable(ctx, uid, r); err != nil || !ok {
			if err != nil {
				return err
			}
			continue
		}
		if c.Phase == checkpoint.PrepareStarted {
			logger.Info("Rolling back a prepare interrupted by a crash", "claim", klog.KRef(c.Namespace, c.Name), "uid", uid)
		} else {
			logger.Info("Finishing an unprepare interrupted by a crash", "claim", klog.KRef(c.Namespace, c.Name), "uid", uid)
		}
		if err := m.removeSpecs(uid); err != nil {
			return err
		}
		if c.MPS != nil || c.IMEX != nil {
			r.daemons = append(r.daemons, c)
		}
		if err := m.destroyPartitions(ctx, c.Devices); err != nil {
			return fmt.Errorf("claim %s: %w", claimRef(c.Namespace, c.Name), err)
		}
		delete(data.Claims, uid)
	}
	if err := m.removeOrphanSpecs(ctx, data, r); err != nil {
		return err
	}
	if err := m.reportForeignPartitions(ctx, data); err != nil {
		return err
	}
	m.data = data
	m.owners = ownersOf(data)
	if err := m.cfg.Checkpoint.Save(m.data); err != nil {
		return fmt.Errorf("write checkpoint: %w", err)
	}
	// Settings of GPUs whose claims were rolled back or finished go back
	// to what they were.
	if err := m.reconcileHeld(ctx, m.originalGPUs()); err != nil {
		return fmt.Errorf("restore GPU settings: %w", err)
	}
	return nil
}

// loadOrRebuild loads the checkpoint. A corrupted one is copied aside (for
// a post-mortem) and rebuilt from the CDI specs on disk, and rebuilt says
// so: the caller writes the rebuilt state over it. Until then a crash finds
// the corrupted file again and rebuilds again.
func (m *Manager) loadOrRebuild(ctx context.Context) (data checkpoint.Data, rebuilt bool, err error) {
	data, err = m.cfg.Checkpoint.Load()
	if !errors.Is(err, checkpoint.ErrCorrupt) {
		return data, false, err
	}
	kept, qerr := m.cfg.Checkpoint.Quarantine(strconv.FormatInt(time.Now().Unix(), 10))
	klog.FromContext(ctx).Error(err, "Checkpoint is corrupted; rebuilding it from the CDI specs on disk", "copiedTo", kept, "copyErr", qerr)
	failpoint(fpQuarantine)
	data, err = m.rebuildFromCDI(ctx)
	return data, true, err
}

// ownersOf lists the exclusive holder of each held device.
func ownersOf(data checkpoint.Data) map[string]types.UID {
	owners := map[string]types.UID{}
	for uid, c := range data.Claims {
		for _, d := range c.Devices {
			if !d.AdminAccess && d.ShareID == "" {
				owners[d.Device] = types.UID(uid)
			}
		}
	}
	return owners
}

// removeOrphanSpecs deletes CDI specs of ours, GPU and gang domain claims'
// alike, that no claim owns (nor, in a rolling update, the other instance
// is writing: a domain claim's spec precedes its record).
func (m *Manager) removeOrphanSpecs(ctx context.Context, data checkpoint.Data, r *recovered) error {
	for _, store := range m.specStores() {
		specs, _ := store.List()
		for _, s := range specs {
			if _, ok := data.Claims[s.ClaimUID]; ok {
				continue
			}
			if ok, err := m.settleable(ctx, s.ClaimUID, r); err != nil || !ok {
				if err != nil {
					return err
				}
				continue
			}
			klog.FromContext(ctx).Info("Removing a CDI spec that no prepared claim owns", "uid", s.ClaimUID, "claim", klog.KRef(s.ClaimNamespace, s.ClaimName), "path", store.Path(s.ClaimUID))
			if err := store.Remove(s.ClaimUID); err != nil {
				return err
			}
		}
	}
	return nil
}

// Reload replaces the in-memory state with the checkpoint on disk, under
// the node lock in a rolling update.
func (m *Manager) Reload(ctx context.Context) error {
	if m.cfg.Shared == nil {
		return m.reload(ctx)
	}
	return m.locked(ctx, func() error { return nil })
}

// locked runs fn as a critical section of the prepared state. With one
// instance serving the node that is fn alone: m.mu guards memory and the
// checkpoint is written from it. Two plugin instances serve side by side
// during a rolling update, and the kubelet may prepare a claim through one
// and unprepare it through the other: the checkpoint on disk is then the
// state, and fn runs under the node lock both hold, starting from what is
// on disk (reload), and every change it makes is on disk before locked
// returns. Every claim on the node waits for that lock: fn must never call
// the API server or wait for anything but the checkpoint and NVML's
// settings calls.
//
// The sections of this process's claims are run in batches (group commit,
// as persist does for one instance): one of the waiting callers leads,
// takes the node lock once, reloads once, runs every section waiting, in
// turn, and writes their changes in one checkpoint write (persist, called
// by a section, only marks the batch dirty; persistNow writes at once
// what must be on disk before the section goes on). Each caller then
// learns its own section's error, or the write's. Memory is never trusted
// across batches: each starts from the disk, so a failed write leaves
// nothing behind but the error.
func (m *Manager) locked(ctx context.Context, fn func() error) error {
	if m.cfg.Shared == nil {
		return fn()
	}
	r := &section{fn: fn, done: make(chan error, 1), lead: make(chan struct{})}
	m.sections.Add(1)
	defer m.sections.Add(-1)
	m.batchMu.Lock()
	m.pending = append(m.pending, r)
	leader := !m.leading
	m.leading = true
	m.batchMu.Unlock()
	if !leader {
		select {
		case err := <-r.done:
			return err
		case <-r.lead:
		}
	}
	m.batchMu.Lock()
	batch := m.pending
	m.pending = nil
	m.batchMu.Unlock()
	m.runBatch(ctx, batch)
	m.batchMu.Lock()
	if len(m.pending) > 0 {
		close(m.pending[0].lead) // the next batch's leader
	} else {
		m.leading = false
	}
	m.batchMu.Unlock()
	return <-r.done
}

// section is a caller of locked waiting for its turn.
type section struct {
	fn   func() error
	done chan error
	// lead is closed to make the caller lead the next batch.
	lead chan struct{}
}

// runBatch runs the sections under the node lock, from the checkpoint on
// disk, and writes their changes once.
func (m *Manager) runBatch(ctx context.Context, batch []*section) {
	errs := make([]error, len(batch))
	err := func() error {
		unlock, err := m.cfg.Shared.LockNode()
		if err != nil {
			return err
		}
		defer unlock()
		if err := m.reload(ctx); err != nil {
			return err
		}
		m.inBatch.Store(true)
		for i, s := range batch {
			errs[i] = s.fn()
		}
		m.inBatch.Store(false)
		m.mu.Lock()
		v := m.version
		m.mu.Unlock()
		return m.persistNow(v)
	}()
	for i, s := range batch {
		if errs[i] == nil {
			errs[i] = err
		}
		s.done <- errs[i]
	}
}

// lockClaim takes a claim's lock: this process's, and in a rolling update
// the one both instances share.
func (m *Manager) lockClaim(uid types.UID) (func(), error) {
	unlock := m.claimLocks.lock(uid)
	if m.cfg.Shared == nil {
		return unlock, nil
	}
	unlockShared, err := m.cfg.Shared.LockClaim(uid)
	if err != nil {
		unlock()
		return nil, err
	}
	return func() { unlockShared(); unlock() }, nil
}

// Snapshot returns the claims prepared now: in a rolling update, as on disk.
func (m *Manager) Snapshot(ctx context.Context) (map[types.UID]checkpoint.Claim, error) {
	var out map[types.UID]checkpoint.Claim
	err := m.locked(ctx, func() error {
		out = m.PreparedClaims()
		return nil
	})
	return out, err
}

// reload replaces the in-memory state with the checkpoint on disk. A
// corrupted checkpoint is rebuilt from the CDI specs as at start
// (loadOrRebuild) and written over it at once, still under the node lock,
// so that the other instance's next reload finds the rebuilt file.
func (m *Manager) reload(ctx context.Context) error {
	m.fileMu.Lock()
	defer m.fileMu.Unlock()
	data, rebuilt, err := m.loadOrRebuild(ctx)
	if err != nil {
		return fmt.Errorf("reload prepared claims: %w", err)
	}
	if rebuilt {
		if err := m.cfg.Checkpoint.Save(data); err != nil {
			return fmt.Errorf("reload prepared claims: write the rebuilt checkpoint: %w", err)
		}
		failpoint(fpReloadRebuilt)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.data = data
	m.owners = ownersOf(data)
	// What is in memory is what is on disk.
	m.version++
	m.written = m.version
	return nil
}

// Inventory is what the node hands out.
func (m *Manager) Inventory() *inventory.Inventory { return m.inventory() }

func (m *Manager) inventory() *inventory.Inventory { return m.inv.Load() }

// SetInventory replaces what the node hands out, for new prepares. Claims
// already prepared keep their devices: each checkpointed partition carries
// its own location, so unprepare does not depend on the inventory.
func (m *Manager) SetInventory(inv *inventory.Inventory) { m.inv.Store(inv) }

// PreparedClaims returns the UIDs of the claims currently prepared.
func (m *Manager) PreparedClaims() map[types.UID]checkpoint.Claim {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make(map[types.UID]checkpoint.Claim, len(m.data.Claims))
	for uid, c := range m.data.Claims {
		out[types.UID(uid)] = c
	}
	return out
}

// Record is a claim's record now, if the node holds one.
func (m *Manager) Record(uid types.UID) (checkpoint.Claim, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	c, ok := m.data.Claims[string(uid)]
	return c, ok
}

// changed records that m.data changed and returns the change's version;
// m.mu must be held.
func (m *Manager) changed() uint64 {
	m.version++
	return m.version
}

// persist returns once a checkpoint holding change v is on disk. Writes are
// batched (group commit): whoever takes the file lock writes the newest
// state, covering every change made so far, and the claims waiting behind
// it find their change already written and return without an fsync of
// their own. Inside a rolling update's batch of sections (locked) the
// batch's one write at its end covers it. Call it without m.mu.
func (m *Manager) persist(v uint64) error {
	if m.inBatch.Load() {
		return nil
	}
	return m.persistNow(v)
}

// persistNow is persist for a change that must be on disk before the
// caller goes on, inside a batch too (a GPU setting's original, before the
// setting changes).
func (m *Manager) persistNow(v uint64) error {
	m.fileMu.Lock()
	defer m.fileMu.Unlock()
	if m.written >= v {
		return nil
	}
	m.mu.Lock()
	upTo := m.version
	raw, err := checkpoint.Encode(m.data)
	m.mu.Unlock()
	if err == nil {
		err = m.cfg.Checkpoint.Write(raw)
	}
	if err != nil {
		return fmt.Errorf("write checkpoint: %w", err)
	}
	m.written = upTo
	return nil
}

// keyedMutex serialises operations per key without a global lock.
type keyedMutex struct {
	mu    sync.Mutex
	locks map[types.UID]*refMutex
}

type refMutex struct {
	sync.Mutex
	refs int
}

func (k *keyedMutex) lock(key types.UID) func() {
	k.mu.Lock()
	if k.locks == nil {
		k.locks = map[types.UID]*refMutex{}
	}
	l := k.locks[key]
	if l == nil {
		l = &refMutex{}
		k.locks[key] = l
	}
	l.refs++
	k.mu.Unlock()
	l.Lock()
	return func() {
		l.Unlock()
		k.mu.Lock()
		l.refs--
		if l.refs == 0 {
			delete(k.locks, key)
		}
		k.mu.Unlock()
	}
}
