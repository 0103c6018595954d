package prepare

import (
	"context"
	"fmt"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2"

	"github.com/tessera-dev/tessera/cdi"
	"github.com/tessera-dev/tessera/driver/checkpoint"
)

// Gang domain claims (driver/domain) hold nothing on the node: preparing one
// writes a CDI spec of the domain class (Config.DomainCDI), nothing else.
// They are recorded in the checkpoint all the same, without devices, so that
// a restart removes a domain spec no checkpointed claim owns, as it does a
// GPU claim's, and keeps one whose claim is prepared.

// PrepareDomain prepares a gang domain claim with prepare (the domain
// preparer, which writes the claim's spec and nothing else), starts the
// node's IMEX daemon for it when it needs one, and records it as prepared.
// Without a daemon there is no started mark to wait for: a crash before the
// record leaves only the spec, which the next start removes as an orphan,
// and the kubelet's retry prepares the claim afresh. A daemon's location is
// recorded before it is started (PrepareStarted, or on the completed record
// of a claim prepared before it had one), so that a crash at any step can
// stop it; a daemon that does not become ready fails the prepare, naming
// why, and the kubelet retries.
func (m *Manager) PrepareDomain(ctx context.Context, claim *resourceapi.ResourceClaim, prepare func(context.Context, *resourceapi.ResourceClaim) ([]kubeletplugin.Device, error)) ([]kubeletplugin.Device, error) {
	uid := claim.UID
	ref := claimRef(claim.Namespace, claim.Name)
	unlock, err := m.lockClaim(uid)
	if err != nil {
		return nil, fmt.Errorf("claim %s: %w", ref, err)
	}
	defer unlock()

	read := func() (rec checkpoint.Claim, ok bool, err error) {
		err = m.locked(ctx, func() error {
			m.mu.Lock()
			rec, ok = m.data.Claims[string(uid)]
			m.mu.Unlock()
			return nil
		})
		return rec, ok, err
	}
	rec, ok, err := read()
	if err != nil {
		return nil, fmt.Errorf("claim %s: %w", ref, err)
	}
	if ok && rec.Phase == checkpoint.UnprepareStarted {
		// An unprepare that did not finish: finish it before preparing
		// afresh, so its daemon is not taken for this prepare's.
		if _, err := m.unprepareHeld(ctx, uid, nil); err != nil {
			return nil, err
		}
		if rec, ok, err = read(); err != nil {
			return nil, fmt.Errorf("claim %s: %w", ref, err)
		}
	}
	if ok && !rec.Domain && len(rec.Devices) > 0 {
		return nil, fmt.Errorf("claim %s: already prepared with devices %s, now allocated gang domain devices; unprepare it first", ref, names(rec.Devices))
	}
	// daemon is the one this prepare starts; recorded, the one its
	// completed record keeps: a daemon an earlier attempt recorded (the
	// other instance of a rolling update, with IMEX daemons on) stays
	// recorded when this one starts none, so that the unprepare stops it.
	var daemon, recorded *checkpoint.Daemon
	if ok {
		recorded = rec.IMEX
	}
	if m.needsIMEX(claim) {
		at := m.cfg.IMEX.Locate(string(uid))
		daemon, recorded = &at, &at
		if !ok || rec.IMEX == nil {
			phase := checkpoint.PrepareStarted
			if ok && rec.Phase == checkpoint.PrepareCompleted {
				phase = checkpoint.PrepareCompleted
			}
			err = m.recordDomain(ctx, uid, checkpoint.Claim{Namespace: claim.Namespace, Name: claim.Name, Phase: phase, Domain: true, IMEX: daemon})
			if err != nil {
				return nil, fmt.Errorf("claim %s: %w", ref, err)
			}
			rec, ok = checkpoint.Claim{Phase: phase, Domain: true, IMEX: daemon}, true
			failpoint(fpPrepareStarted)
		}
	}
	devs, err := prepare(ctx, claim)
	if err != nil {
		return nil, err
	}
	failpoint(fpCDIWrite)
	if daemon != nil {
		if err := m.startIMEX(ctx, claim, *daemon); err != nil {
			return nil, fmt.Errorf("claim %s: %w", ref, err)
		}
	}
	if ok && rec.Domain && rec.Phase == checkpoint.PrepareCompleted {
		return devs, nil
	}
	err = m.recordDomain(ctx, uid, checkpoint.Claim{Namespace: claim.Namespace, Name: claim.Name, Phase: checkpoint.PrepareCompleted, Domain: true, IMEX: recorded})
	if err != nil {
		return nil, fmt.Errorf("claim %s: %w", ref, err)
	}
	failpoint(fpPrepareCompleted)
	return devs, nil
}

// recordDomain makes rec the domain claim's record, in memory and on disk
// (the claim's lock held). If the write fails, memory goes back to the
// record on disk: memory saying prepared would answer the kubelet's retry
// from a record no restart knows (a restart would roll the claim back
// under its pods), and memory holding a started mark the disk lacks would
// let the retry start a daemon before any record of it is on disk.
func (m *Manager) recordDomain(ctx context.Context, uid types.UID, rec checkpoint.Claim) error {
	return m.locked(ctx, func() error {
		m.mu.Lock()
		was, had := m.data.Claims[string(uid)]
		m.data.Claims[string(uid)] = rec
		v := m.changed()
		m.mu.Unlock()
		err := m.persist(v)
		if err != nil {
			m.mu.Lock()
			if had {
				m.data.Claims[string(uid)] = was
			} else {
				delete(m.data.Claims, string(uid))
			}
			m.changed()
			m.mu.Unlock()
		}
		return err
	})
}

// recordDomainSpecs records as prepared the claim of every domain spec of
// this boot (or of none: written before specs carried one) that data does
// not hold, and marks data as recording domain claims. It serves a
// checkpoint rebuilt from the specs and one written before domain claims
// were recorded: their pods may be running, so their specs are kept.
func (m *Manager) recordDomainSpecs(ctx context.Context, data *checkpoint.Data) {
	if m.cfg.DomainCDI == nil {
		return
	}
	logger := klog.FromContext(ctx)
	specs, err := m.cfg.DomainCDI.List()
	if err != nil {
		logger.Error(err, "Some gang domain claim specs could not be read; left out of the checkpoint")
	}
	for _, s := range specs {
		if _, ok := data.Claims[s.ClaimUID]; ok || (s.BootID != "" && s.BootID != m.cfg.BootID) {
			continue
		}
		logger.Info("Recording a gang domain claim from its CDI spec", "claim", klog.KRef(s.ClaimNamespace, s.ClaimName), "uid", s.ClaimUID)
		rec := checkpoint.Claim{Namespace: s.ClaimNamespace, Name: s.ClaimName, Phase: checkpoint.PrepareCompleted, Domain: true}
		if m.cfg.IMEX != nil {
			// The claim may have a daemon (an NVLink domain's): its
			// unprepare stops it, and stopping none succeeds.
			at := m.cfg.IMEX.Locate(s.ClaimUID)
			rec.IMEX = &at
		}
		data.Claims[s.ClaimUID] = rec
	}
	data.DomainClaims = true
}

// specStores are the stores of the specs a claim may have: the GPU claims'
// and, if set, the gang domain claims'.
func (m *Manager) specStores() []*cdi.Store {
	if m.cfg.DomainCDI == nil {
		return []*cdi.Store{m.cfg.CDI}
	}
	return []*cdi.Store{m.cfg.CDI, m.cfg.DomainCDI}
}

// removeSpecs removes a claim's spec from every store: a record rewritten
// by an older instance in a rolling update may have lost its Domain mark,
// and removing a missing file succeeds.
func (m *Manager) removeSpecs(uid string) error {
	for _, s := range m.specStores() {
		if err := s.Remove(uid); err != nil {
			return err
		}
	}
	return m.cfg.HostNodes.Release(context.Background(), uid)
}
