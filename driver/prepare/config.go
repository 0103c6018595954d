package prepare

import (
	"fmt"
	"slices"
	"strings"

	resourceapi "k8s.io/api/resource/v1"

	"github.com/tessera-dev/tessera/api/gpu/v1alpha1"
	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/gpuset"
	"github.com/tessera-dev/tessera/driver/inventory"
)

// decoded is one opaque configuration of this driver with the requests it
// applies to (none: all).
type decoded struct {
	requests []string
	cfg      v1alpha1.Config
}

// decodeConfigs reads the claim's configurations for this driver in the
// order DRA hands them over (class first, then claim), refusing what is
// malformed: a claim never runs with a configuration silently ignored.
func (m *Manager) decodeConfigs(claim *resourceapi.ResourceClaim) ([]decoded, error) {
	var out []decoded
	for i, c := range claim.Status.Allocation.Devices.Config {
		if c.Opaque == nil || c.Opaque.Driver != m.cfg.DriverName {
			continue
		}
		cfg, err := v1alpha1.Decode(c.Opaque.Parameters.Raw)
		if err != nil {
			return nil, fmt.Errorf("device config %d (from %s): %w", i, c.Source, err)
		}
		out = append(out, decoded{requests: c.Requests, cfg: cfg})
	}
	return out, nil
}

// appliesTo says whether a configuration for requests covers a result of
// request r (a subrequest "parent/sub" is covered by its parent).
func appliesTo(requests []string, r string) bool {
	if len(requests) == 0 {
		return true
	}
	parent, _, _ := strings.Cut(r, "/")
	return slices.Contains(requests, r) || slices.Contains(requests, parent)
}

// mpsPlan is what a claim's MPS configuration asks: one control daemon for
// all its MPS devices.
type mpsPlan struct {
	config  *v1alpha1.MPSConfig
	devices []int // indexes into the claim's devices
}

// plan resolves, for each of the claim's devices, the configuration that
// applies to it and records what it needs of its GPU (settings) in devs. It
// returns the claim's MPS needs, or nil.
func (m *Manager) plan(claim *resourceapi.ResourceClaim, devs []checkpoint.Device) (*mpsPlan, error) {
	configs, err := m.decodeConfigs(claim)
	if err != nil {
		return nil, err
	}
	var mps *mpsPlan
	for i := range devs {
		d := &devs[i]
		inv, ok := m.inventory().Lookup(d.Device)
		if !ok || d.AdminAccess {
			continue
		}
		var applied []v1alpha1.Config
		for _, c := range configs {
			if slices.ContainsFunc(d.Requests, func(r string) bool { return appliesTo(c.requests, r) }) {
				applied = append(applied, c.cfg)
			}
		}
		gpuCfg, migCfg := v1alpha1.Merge(applied...)
		var sharing *v1alpha1.Sharing
		var settings checkpoint.Settings
		if inv.Kind == inventory.Whole {
			if gpuCfg != nil {
				sharing = gpuCfg.Sharing
				if w := gpuCfg.PowerLimitWatts; w != nil {
					g := inv.GPU
					if g.PowerMaxWatts > 0 && (int64(*w) < g.PowerMinWatts || int64(*w) > g.PowerMaxWatts) {
						return nil, fmt.Errorf("device %s: powerLimitWatts %d is outside the GPU's range %d..%d W (attributes powerMinWatts, powerMaxWatts); choose a limit in that range", d.Device, *w, g.PowerMinWatts, g.PowerMaxWatts)
					}
					settings.PowerLimitMW = uint32(*w) * 1000
				}
			}
			if inv.Share.Shared() {
				// Processes of independent claims run side by side.
				settings.ComputeMode = gpuset.ComputeDefault
			}
		} else if migCfg != nil {
			sharing = migCfg.Sharing
		}
		if sharing != nil {
			switch sharing.Strategy {
			case v1alpha1.TimeSlicing:
				settings.ComputeMode = gpuset.ComputeDefault
			case v1alpha1.MPS:
				if inv.Share.Shared() {
					return nil, fmt.Errorf("device %s: sharing strategy MPS is not available on a GPU that independent claims share (time slices or memory shares): its MPS server would serve other claims' pods; use a device of class gpu.tessera.dev or mig.gpu.tessera.dev and share the claim between pods", d.Device)
				}
				if inv.Kind == inventory.Whole {
					// The MPS server is the GPU's one process; clients
					// reach the GPU only through it.
					settings.ComputeMode = gpuset.ComputeExclusiveProcess
				}
				if mps == nil {
					mps = &mpsPlan{config: sharing.MPSConfig}
				}
				mps.devices = append(mps.devices, i)
			}
		}
		if settings != (checkpoint.Settings{}) {
			if m.cfg.Settings == nil {
				return nil, fmt.Errorf("device %s needs GPU settings changed (compute mode %q, power limit %d mW) but this plugin cannot change GPU settings", d.Device, settings.ComputeMode, settings.PowerLimitMW)
			}
			d.Settings = &settings
			d.GPU = inv.GPU.UUID
		}
	}
	return mps, nil
}
