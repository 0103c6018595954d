package prepare

import (
	"context"
	"fmt"
	"strings"

	"github.com/tessera-dev/tessera/cdi"
	"github.com/tessera-dev/tessera/driver/checkpoint"
)

// MPSDaemons runs one MPS control daemon per claim that asks for MPS
// (driver/mps). Every method is idempotent, so a retried or recovered
// prepare or unprepare can call it again.
type MPSDaemons interface {
	// Locate says where a claim's daemon lives; it is checkpointed before
	// Start so that a crash can always stop what was started.
	Locate(claimUID string) checkpoint.MPSDaemon
	// Start runs the daemon (or finds it running) and returns once it
	// serves, with what its clients' containers need.
	Start(ctx context.Context, d MPSDaemon) (cdi.Edits, error)
	// Stop stops a daemon and removes its files.
	Stop(ctx context.Context, d checkpoint.MPSDaemon) error
	// Runs says whether Start can start daemons. Without (no image),
	// Locate and Stop still clean up what an earlier configuration
	// started, and claims asking for MPS are refused.
	Runs() bool
}

// MPSDaemon is what a claim's daemon serves.
type MPSDaemon struct {
	checkpoint.MPSDaemon
	ClaimUID, ClaimNamespace, ClaimName string
	// Devices are the UUIDs of the GPUs or MIG devices it serves, in the
	// order clients see them.
	Devices []string
	// Env are the client defaults the daemon and its clients get:
	// CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and CUDA_MPS_PINNED_DEVICE_MEM_LIMIT.
	Env []string
}

// mpsEnv renders an MPS configuration as the CUDA environment variables
// that apply it: thread percentage, and pinned memory limits per device
// ordinal ("0=10240M,1=2048M").
func (p *mpsPlan) env(count int) []string {
	c := p.config
	if c == nil {
		return nil
	}
	var env []string
	if c.DefaultActiveThreadPercentage != nil {
		env = append(env, fmt.Sprintf("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=%d", *c.DefaultActiveThreadPercentage))
	}
	var limits []string
	for i := range count {
		q := c.DefaultPinnedDeviceMemoryLimit
		if per, ok := c.DefaultPerDevicePinnedMemoryLimit[fmt.Sprint(i)]; ok {
			q = &per
		}
		if q != nil {
			limits = append(limits, fmt.Sprintf("%d=%dM", i, (q.Value()+(1<<20)-1)>>20))
		}
	}
	if len(limits) > 0 {
		env = append(env, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="+strings.Join(limits, ","))
	}
	return env
}

// stopMPS stops a claim's daemon if it has one.
func (m *Manager) stopMPS(ctx context.Context, c checkpoint.Claim) error {
	if c.MPS == nil {
		return nil
	}
	if m.cfg.MPS == nil {
		return fmt.Errorf("claim %s has an MPS daemon (%s) but the plugin was given no way to stop MPS daemons", claimRef(c.Namespace, c.Name), c.MPS.Pod)
	}
	if err := m.cfg.MPS.Stop(ctx, *c.MPS); err != nil {
		return err
	}
	failpoint(fpMPSStop)
	return nil
}
