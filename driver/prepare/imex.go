package prepare

import (
	"context"
	"fmt"

	resourceapi "k8s.io/api/resource/v1"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/domain"
)

// IMEXDaemons runs one IMEX daemon per gang domain claim on an NVLink
// domain (driver/imex). Every method is idempotent, so a retried or
// recovered prepare or unprepare can call it again.
type IMEXDaemons interface {
	// Locate says where a claim's daemon lives; it is checkpointed before
	// Start so that a crash can always stop what was started.
	Locate(claimUID string) checkpoint.Daemon
	// Start configures and runs the daemon (or finds it serving) and
	// returns once it is ready.
	Start(ctx context.Context, d IMEXDaemon) error
	// Stop stops a daemon and removes its files.
	Stop(ctx context.Context, d checkpoint.Daemon) error
	// Runs says whether Start can start daemons. Without (no image),
	// Locate and Stop still clean up what an earlier configuration
	// started, and domain claims get no daemon.
	Runs() bool
}

// IMEXDaemon is what a domain claim's daemon on this node serves.
type IMEXDaemon struct {
	checkpoint.Daemon
	ClaimUID, ClaimNamespace, ClaimName string
	// Nodes are the gang's nodes and addresses, from the claim's
	// gang.tessera.dev/nodes annotation.
	Nodes []gangv1.Node
}

// needsIMEX says whether preparing the claim starts an IMEX daemon: the
// plugin runs them, the gang controller placed the claim (it wrote the
// gang's nodes and the placement on it), and one of the claim's devices is a channel of an
// NVLink domain. A domain claim the scheduler allocated alone, without a
// gang, names no set of nodes to configure: it gets its channel and no
// daemon (docs/gang.md).
func (m *Manager) needsIMEX(claim *resourceapi.ResourceClaim) bool {
	if m.cfg.IMEX == nil || !m.cfg.IMEX.Runs() || claim.Status.Allocation == nil {
		return false
	}
	if _, ok := claim.Annotations[gangv1.AnnotationNodes]; !ok || claim.Annotations[gangv1.AnnotationPlacement] == "" {
		return false
	}
	for _, r := range claim.Status.Allocation.Devices.Results {
		if kind, _, ok := domain.ParsePool(r.Pool); ok && kind == domain.KindNVLink && r.Driver == m.cfg.DriverName {
			return true
		}
	}
	return false
}

// startIMEX starts the claim's IMEX daemon at its recorded location.
func (m *Manager) startIMEX(ctx context.Context, claim *resourceapi.ResourceClaim, at checkpoint.Daemon) error {
	nodes, err := gangv1.ParseNodes(claim.Annotations[gangv1.AnnotationNodes])
	if err != nil {
		return err
	}
	err = m.cfg.IMEX.Start(ctx, IMEXDaemon{Daemon: at, ClaimUID: string(claim.UID), ClaimNamespace: claim.Namespace, ClaimName: claim.Name, Nodes: nodes})
	if err != nil {
		return fmt.Errorf("IMEX daemon: %w", err)
	}
	failpoint(fpIMEXStart)
	return nil
}

// stopDaemons stops a claim's daemons, if it has any: its MPS control
// daemon, its IMEX daemon.
func (m *Manager) stopDaemons(ctx context.Context, c checkpoint.Claim) error {
	if err := m.stopMPS(ctx, c); err != nil {
		return err
	}
	if c.IMEX == nil {
		return nil
	}
	if m.cfg.IMEX == nil {
		return fmt.Errorf("claim %s has an IMEX daemon (%s) but the plugin was given no way to stop IMEX daemons", claimRef(c.Namespace, c.Name), c.IMEX.Pod)
	}
	if err := m.cfg.IMEX.Stop(ctx, *c.IMEX); err != nil {
		return err
	}
	failpoint(fpIMEXStop)
	return nil
}
