package prepare

import (
	"context"
	"fmt"
	"os"

	"k8s.io/apimachinery/pkg/types"

	"github.com/tessera-dev/tessera/cdi"
)

// Device nodes the driver makes only on demand (driver/hostnodes) are made
// once a claim's spec is written and released once it is removed
// (removeSpecs, rollback): a node record without a spec is what a crash
// left, and the start's sweep (Manager.HasSpec) releases it.

// ensureHostNodes makes the claim's on-demand nodes on the host.
func (m *Manager) ensureHostNodes(ctx context.Context, uid types.UID, spec cdi.ClaimSpec) error {
	nodes := spec.Common.DeviceNodes
	for _, d := range spec.Devices {
		nodes = append(nodes, d.DeviceNodes...)
	}
	if err := m.cfg.HostNodes.Ensure(ctx, string(uid), nodes); err != nil {
		return fmt.Errorf("make device nodes on the host: %w", err)
	}
	return nil
}

// HasSpec says whether a claim has a CDI spec, GPU or gang domain claim's:
// the device nodes of one that has none are released at start.
func (m *Manager) HasSpec(uid string) bool {
	for _, s := range m.specStores() {
		if _, err := os.Lstat(s.Path(uid)); err == nil {
			return true
		}
	}
	return false
}
