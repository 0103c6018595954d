// Package health keeps each GPU's health from NVML events and probes: it turns
// XIDs, ECC errors and lost GPUs into device taints and health states, lifts
// them when a GPU has been quiet and answers again, and tells subscribers of
// every change.
package health

import (
	"fmt"
	"time"

	"github.com/spf13/pflag"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/utils/clock"
)

// Taint keys, in the driver's domain. Values name the cause ("79",
// "double-bit", "gpu-is-lost").
const (
	// KeyXID marks a GPU that reported an XID critical error; the value is
	// the XID. Application XIDs (see DefaultIgnoredXIDs) use effect None.
	KeyXID = "gpu.tessera.dev/xid"
	// KeyECC marks a GPU with an uncorrectable (double-bit) memory error.
	KeyECC = "gpu.tessera.dev/ecc"
	// KeyLost marks a GPU that NVML cannot reach: fallen off the bus
	// (ERROR_GPU_IS_LOST) or failing its probe otherwise.
	KeyLost = "gpu.tessera.dev/lost"
	// KeyUnmonitored marks (effect None) a GPU whose events cannot be
	// watched: its health is unknown, never silently healthy.
	KeyUnmonitored = "gpu.tessera.dev/unmonitored"
)

// DefaultIgnoredXIDs are XIDs caused by applications (illegal memory access,
// page faults, stopped channels, preemptive cleanup, ...) that say nothing
// about the GPU itself. They give an informational taint only.
var DefaultIgnoredXIDs = []uint{13, 31, 43, 45, 68, 109}

// Status is a device's health as the kubelet sees it.
type Status string

// The health states; their values match kubeletplugin.HealthStatus.
const (
	Healthy   Status = "Healthy"
	Unhealthy Status = "Unhealthy"
	Unknown   Status = "Unknown"
)

// DeviceState is one GPU's current health.
type DeviceState struct {
	// Name is the device name in ResourceSlices (gpu-<index>).
	Name  string
	Index int
	UUID  string
	// Status is Unhealthy while any taint has effect NoSchedule, Unknown
	// while the GPU is unmonitored, else Healthy.
	Status Status
	// Taints are the device's taints, sorted by key. TimeAdded stays the
	// same while a taint persists unchanged.
	Taints []resourceapi.DeviceTaint
	// Message says why, for people.
	Message string
	// Since is when Status last changed.
	Since time.Time
}

// Snapshot is the state of every GPU of the node, by index.
type Snapshot []DeviceState

// Taints returns the snapshot's taints by device name, for slices.
func (s Snapshot) Taints() map[string][]resourceapi.DeviceTaint {
	out := map[string][]resourceapi.DeviceTaint{}
	for _, d := range s {
		if len(d.Taints) > 0 {
			out[d.Name] = d.Taints
		}
	}
	return out
}

// Options tune the monitor.
type Options struct {
	// QuietPeriod is how long a faulty GPU must report no fault, and then
	// pass a probe, before its taints are lifted.
	QuietPeriod time.Duration
	// IgnoredXIDs are added to DefaultIgnoredXIDs.
	IgnoredXIDs []uint
	// ProbeInterval is how often every GPU is probed (GetUUID,
	// GetMemoryInfo) to find lost GPUs and recoveries.
	ProbeInterval time.Duration
	// WaitTimeout bounds one NVML event wait; the monitor checks probes and
	// its context between waits. Zero means one second.
	WaitTimeout time.Duration
	// Clock is the time source; nil means the real clock.
	Clock clock.WithTicker
	// Metrics receives event counts and health gauges; nil means none.
	Metrics *Metrics
	// StatePath is the file that keeps the GPUs' fault taints across
	// restarts (contract in state.go); empty means they are not kept. Its
	// directory must exist.
	StatePath string
}

// AddFlags registers the options' flags.
func (o *Options) AddFlags(fs *pflag.FlagSet) {
	fs.DurationVar(&o.QuietPeriod, "health-quiet-period", 5*time.Minute, "How long a faulty GPU must report no XID or ECC error, and then answer NVML, before its taints are lifted.")
	fs.UintSliceVar(&o.IgnoredXIDs, "ignored-xids", nil, fmt.Sprintf("XIDs, besides %v, that applications cause and that only mark a GPU with an informational taint (effect None).", DefaultIgnoredXIDs))
	fs.DurationVar(&o.ProbeInterval, "health-probe-interval", 10*time.Second, "How often every GPU is probed through NVML to find lost GPUs and recoveries.")
}

// Validate checks the options; zero values mean the defaults.
func (o *Options) Validate() error {
	if o.QuietPeriod < 0 {
		return fmt.Errorf("--health-quiet-period %s: want a positive duration", o.QuietPeriod)
	}
	if o.ProbeInterval < 0 {
		return fmt.Errorf("--health-probe-interval %s: want a positive duration", o.ProbeInterval)
	}
	return nil
}

func (o Options) withDefaults() Options {
	if o.QuietPeriod <= 0 {
		o.QuietPeriod = 5 * time.Minute
	}
	if o.ProbeInterval <= 0 {
		o.ProbeInterval = 10 * time.Second
	}
	if o.WaitTimeout <= 0 {
		o.WaitTimeout = time.Second
	}
	if o.Clock == nil {
		o.Clock = clock.RealClock{}
	}
	return o
}
