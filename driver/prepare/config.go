package prepare

import (
	"fmt"

	resourceapi "k8s.io/api/resource/v1"

	"github.com/tessera-dev/tessera/api/gpu/v1alpha1"
)

// checkConfigs decodes the claim's opaque configurations for this driver,
// in the order DRA hands them over (class first, then claim), and refuses
// what is malformed and what this version cannot apply yet: a claim never
// runs with a configuration silently ignored.
func (m *Manager) checkConfigs(claim *resourceapi.ResourceClaim) error {
	var decoded []v1alpha1.Config
	for i, c := range claim.Status.Allocation.Devices.Config {
		if c.Opaque == nil || c.Opaque.Driver != m.cfg.DriverName {
			continue
		}
		cfg, err := v1alpha1.Decode(c.Opaque.Parameters.Raw)
		if err != nil {
			return fmt.Errorf("device config %d (from %s): %w", i, c.Source, err)
		}
		decoded = append(decoded, cfg)
	}
	gpu, mig := v1alpha1.Merge(decoded...)
	var sharing []*v1alpha1.Sharing
	if gpu != nil {
		if gpu.PowerLimitWatts != nil {
			return fmt.Errorf("powerLimitWatts is not supported by this version of the plugin yet; remove it from the GpuConfig")
		}
		sharing = append(sharing, gpu.Sharing)
	}
	if mig != nil {
		sharing = append(sharing, mig.Sharing)
	}
	for _, s := range sharing {
		if s != nil && s.Strategy != v1alpha1.Exclusive {
			return fmt.Errorf("sharing strategy %s is not supported by this version of the plugin yet; use Exclusive or share one claim between pods", s.Strategy)
		}
	}
	return nil
}
