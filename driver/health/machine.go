package health

import (
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/tessera-dev/tessera/driver/gpulib"
)

// The state machine, per GPU:
//
//	healthy ──XID/double-bit ECC/failed probe──> tainted (NoSchedule: unhealthy)
//	healthy ──application XID──────────────────> tainted (None: still healthy)
//	tainted ──another fault────────────────────> tainted, quiet period restarts
//	tainted ──quiet period over, probe passes──> healthy (all taints lifted)
//	any     ──cannot register for events───────> + unmonitored taint (None: unknown)
//
// A taint is never downgraded by a milder fault with the same key: an
// application XID after XID 79 leaves the NoSchedule taint in place. The
// machine is pure: it reads no clock and calls no NVML; the monitor feeds it
// events, probe results and the time.

// event is one NVML event, classified.
type event struct {
	kind string // one of the kind* constants
	xid  uint64
}

// Event kinds, as counted by the tessera_health_events_total metric.
const (
	kindXID          = "xid"
	kindDoubleBitECC = "ecc-double-bit"
	kindSingleBitECC = "ecc-single-bit"
	kindLost         = "lost"
)

type device struct {
	index       int
	name, uuid  string
	taints      map[string]resourceapi.DeviceTaint
	lastFault   time.Time
	unmonitored string // why, empty when events are watched
	status      Status
	since       time.Time
}

type machine struct {
	quiet   time.Duration
	ignored map[uint64]bool
	devices []*device
}

func newMachine(quiet time.Duration, ignored []uint, devices []*device, now time.Time) *machine {
	m := &machine{quiet: quiet, ignored: map[uint64]bool{}, devices: devices}
	for _, x := range append(append([]uint(nil), DefaultIgnoredXIDs...), ignored...) {
		m.ignored[uint64(x)] = true
	}
	for _, d := range devices {
		d.taints = map[string]resourceapi.DeviceTaint{}
		d.status, d.since = Healthy, now
	}
	return m
}

// observe applies an event to GPU i and says whether its state changed.
func (m *machine) observe(i int, ev event, now time.Time) bool {
	d := m.devices[i]
	var changed bool
	switch ev.kind {
	case kindXID:
		effect := resourceapi.DeviceTaintEffectNoSchedule
		if m.ignored[ev.xid] {
			effect = resourceapi.DeviceTaintEffectNone
		}
		changed = d.taint(KeyXID, strconv.FormatUint(ev.xid, 10), effect, now)
	case kindDoubleBitECC:
		changed = d.taint(KeyECC, "double-bit", resourceapi.DeviceTaintEffectNoSchedule, now)
	default:
		// Corrected errors are counted, not acted on.
		return false
	}
	d.lastFault = now
	return d.update(now) || changed
}

// probed applies a probe result to GPU i. It says whether the state changed
// and whether the GPU was found lost just now.
func (m *machine) probed(i int, err error, now time.Time) (changed, lost bool) {
	d := m.devices[i]
	if err != nil {
		value := "probe-failed"
		if gpulib.IsGPULost(err) {
			value = "gpu-is-lost"
		}
		_, had := d.taints[KeyLost]
		changed = d.taint(KeyLost, value, resourceapi.DeviceTaintEffectNoSchedule, now)
		d.lastFault = now
		return d.update(now) || changed, !had
	}
	if !d.faulty() || now.Sub(d.lastFault) < m.quiet {
		return false, false
	}
	for k := range d.taints {
		if k != KeyUnmonitored {
			delete(d.taints, k)
		}
	}
	d.update(now)
	return true, false
}

// unmonitor marks GPU i as one whose events cannot be watched.
func (m *machine) unmonitor(i int, why string, now time.Time) {
	d := m.devices[i]
	d.unmonitored = why
	d.taint(KeyUnmonitored, why, resourceapi.DeviceTaintEffectNone, now)
	d.update(now)
}

// monitor marks GPU i as watched again.
func (m *machine) monitor(i int, now time.Time) {
	d := m.devices[i]
	d.unmonitored = ""
	delete(d.taints, KeyUnmonitored)
	d.update(now)
}

func (m *machine) snapshot() Snapshot {
	out := make(Snapshot, 0, len(m.devices))
	for _, d := range m.devices {
		s := DeviceState{Name: d.name, Index: d.index, UUID: d.uuid, Status: d.status, Since: d.since}
		for _, t := range d.taints {
			s.Taints = append(s.Taints, t)
		}
		sortTaints(s.Taints)
		s.Message = message(d, s.Taints)
		out = append(out, s)
	}
	return out
}

func sortTaints(ts []resourceapi.DeviceTaint) {
	sort.Slice(ts, func(a, b int) bool { return ts[a].Key < ts[b].Key })
}

// faulty says whether the GPU carries a taint recovery can lift.
func (d *device) faulty() bool {
	for k := range d.taints {
		if k != KeyUnmonitored {
			return true
		}
	}
	return false
}

// taint sets a taint unless one with the same key is as severe or more. A
// changed value or effect gets a new TimeAdded; an unchanged one keeps it.
func (d *device) taint(key, value string, effect resourceapi.DeviceTaintEffect, now time.Time) bool {
	if old, ok := d.taints[key]; ok {
		if severity(old.Effect) > severity(effect) || (old.Value == value && old.Effect == effect) {
			return false
		}
	}
	// The API stores seconds; a finer time would make every republish a diff.
	t := metav1.NewTime(now.Truncate(time.Second))
	d.taints[key] = resourceapi.DeviceTaint{Key: key, Value: value, Effect: effect, TimeAdded: &t}
	return true
}

// update recomputes the status and says whether it changed.
func (d *device) update(now time.Time) bool {
	status := Healthy
	if d.unmonitored != "" {
		status = Unknown
	}
	for _, t := range d.taints {
		if t.Effect == resourceapi.DeviceTaintEffectNoSchedule {
			status = Unhealthy
		}
	}
	if status == d.status {
		return false
	}
	d.status, d.since = status, now
	return true
}

func severity(e resourceapi.DeviceTaintEffect) int {
	switch e {
	case resourceapi.DeviceTaintEffectNoExecute:
		return 2
	case resourceapi.DeviceTaintEffectNoSchedule:
		return 1
	}
	return 0
}

func message(d *device, taints []resourceapi.DeviceTaint) string {
	if len(taints) == 0 {
		return "no faults reported"
	}
	parts := make([]string, 0, len(taints))
	for _, t := range taints {
		parts = append(parts, fmt.Sprintf("%s=%s:%s", t.Key, t.Value, t.Effect))
	}
	msg := strings.Join(parts, ", ")
	if d.faulty() {
		msg += "; lifted after a quiet period once the GPU answers NVML"
	}
	return msg
}
