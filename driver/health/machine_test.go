package health

import (
	"errors"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/tessera-dev/tessera/driver/gpulib"
)

var t0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

const quiet = 5 * time.Minute

func newTestMachine(ignored ...uint) *machine {
	return newMachine(quiet, ignored, []*device{{index: 0, name: "gpu-0", uuid: "GPU-0"}}, t0)
}

// taints renders a device's taints as key=value:effect, sorted by key.
func taints(s DeviceState) []string {
	var out []string
	for _, t := range s.Taints {
		out = append(out, t.Key+"="+t.Value+":"+string(t.Effect))
	}
	return out
}

func TestFaultsBecomeTaints(t *testing.T) {
	xid := func(x uint64) event { return event{kind: kindXID, xid: x} }
	for _, tc := range []struct {
		name    string
		ignored []uint
		events  []event
		want    []string
		status  Status
	}{
		{name: "fatal XID is NoSchedule", events: []event{xid(48)}, want: []string{"gpu.tessera.dev/xid=48:NoSchedule"}, status: Unhealthy},
		{name: "fallen off the bus is NoSchedule", events: []event{xid(79)}, want: []string{"gpu.tessera.dev/xid=79:NoSchedule"}, status: Unhealthy},
		{name: "application XID is informational", events: []event{xid(13)}, want: []string{"gpu.tessera.dev/xid=13:None"}, status: Healthy},
		{name: "ignored XIDs are extended by option", ignored: []uint{94}, events: []event{xid(94)}, want: []string{"gpu.tessera.dev/xid=94:None"}, status: Healthy},
		{name: "a milder XID does not downgrade a fatal one", events: []event{xid(79), xid(13)}, want: []string{"gpu.tessera.dev/xid=79:NoSchedule"}, status: Unhealthy},
		{name: "a fatal XID upgrades an application one", events: []event{xid(13), xid(94)}, want: []string{"gpu.tessera.dev/xid=94:NoSchedule"}, status: Unhealthy},
		{name: "double-bit ECC is NoSchedule", events: []event{{kind: kindDoubleBitECC}}, want: []string{"gpu.tessera.dev/ecc=double-bit:NoSchedule"}, status: Unhealthy},
		{name: "single-bit ECC is only counted", events: []event{{kind: kindSingleBitECC}}, status: Healthy},
		{name: "XID and ECC both show", events: []event{xid(48), {kind: kindDoubleBitECC}}, want: []string{"gpu.tessera.dev/ecc=double-bit:NoSchedule", "gpu.tessera.dev/xid=48:NoSchedule"}, status: Unhealthy},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := newTestMachine(tc.ignored...)
			for i, ev := range tc.events {
				m.observe(0, ev, t0.Add(time.Duration(i)*time.Second))
			}
			s := m.snapshot()[0]
			if diff := cmp.Diff(tc.want, taints(s)); diff != "" {
				t.Errorf("taints (-want +got):\n%s", diff)
			}
			if s.Status != tc.status {
				t.Errorf("status %s, want %s", s.Status, tc.status)
			}
		})
	}
}

func TestTaintLiftsOnlyAfterQuietPeriodAndPassingProbe(t *testing.T) {
	lost := fmtLost()
	m := newTestMachine()
	m.observe(0, event{kind: kindXID, xid: 48}, t0)
	steps := []struct {
		at      time.Duration
		probe   error
		tainted bool
	}{
		{at: quiet - time.Second, tainted: true},                  // probe passes, but too early
		{at: quiet, probe: lost, tainted: true},                   // quiet, but the GPU does not answer: quiet restarts
		{at: 2*quiet - time.Second, tainted: true},                // passes, but within the restarted quiet period
		{at: 2 * quiet, tainted: false},                           // quiet and answering
		{at: 2*quiet + time.Second, tainted: false},               // stays healthy
		{at: 2*quiet + 2*time.Second, probe: lost, tainted: true}, // lost again: tainted at once
	}
	for _, st := range steps {
		m.probed(0, st.probe, t0.Add(st.at))
		s := m.snapshot()[0]
		if got := len(s.Taints) > 0; got != st.tainted {
			t.Fatalf("at +%s (probe error %v): tainted=%v, want %v; taints %v", st.at, st.probe, got, st.tainted, taints(s))
		}
		if want := map[bool]Status{true: Unhealthy, false: Healthy}[st.tainted]; s.Status != want {
			t.Fatalf("at +%s: status %s, want %s", st.at, s.Status, want)
		}
	}
}

func fmtLost() error { return gpulib.Error(nvml.ERROR_GPU_IS_LOST) }

func TestTaintTimeAddedIsStableWhileTaintPersists(t *testing.T) {
	m := newTestMachine()
	m.observe(0, event{kind: kindXID, xid: 48}, t0.Add(300*time.Millisecond))
	if changed := m.observe(0, event{kind: kindXID, xid: 48}, t0.Add(time.Minute)); changed {
		t.Error("a repeated XID reported a change")
	}
	got := m.snapshot()[0].Taints[0].TimeAdded.Time
	if !got.Equal(t0) {
		t.Errorf("TimeAdded %s, want %s (the first event, to the second)", got, t0)
	}
	m.observe(0, event{kind: kindXID, xid: 79}, t0.Add(2*time.Minute))
	if got := m.snapshot()[0].Taints[0].TimeAdded.Time; !got.Equal(t0.Add(2 * time.Minute)) {
		t.Errorf("a new XID kept TimeAdded %s", got)
	}
}

func TestLostGPUIsTaintedByProbe(t *testing.T) {
	m := newTestMachine()
	changed, lost := m.probed(0, fmtLost(), t0)
	if !changed || !lost {
		t.Fatalf("probe of a lost GPU: changed=%v lost=%v", changed, lost)
	}
	if diff := cmp.Diff([]string{"gpu.tessera.dev/lost=gpu-is-lost:NoSchedule"}, taints(m.snapshot()[0])); diff != "" {
		t.Errorf("taints (-want +got):\n%s", diff)
	}
	if changed, lost := m.probed(0, fmtLost(), t0.Add(time.Second)); changed || lost {
		t.Errorf("a second failing probe: changed=%v lost=%v, want neither", changed, lost)
	}
	m.probed(0, errors.New("other"), t0.Add(2*time.Second))
	if got := m.snapshot()[0].Taints[0].Value; got != "probe-failed" {
		t.Errorf("other probe errors: value %q, want probe-failed", got)
	}
}

func TestUnmonitoredGPUIsUnknownAndKeepsItsMarkThroughRecovery(t *testing.T) {
	m := newTestMachine()
	m.unmonitor(0, "not-supported", t0)
	s := m.snapshot()[0]
	if s.Status != Unknown {
		t.Errorf("status %s, want Unknown", s.Status)
	}
	if diff := cmp.Diff([]string{"gpu.tessera.dev/unmonitored=not-supported:None"}, taints(s)); diff != "" {
		t.Errorf("taints (-want +got):\n%s", diff)
	}
	m.probed(0, fmtLost(), t0)
	if s := m.snapshot()[0]; s.Status != Unhealthy {
		t.Errorf("lost and unmonitored: status %s, want Unhealthy", s.Status)
	}
	m.probed(0, nil, t0.Add(quiet))
	s = m.snapshot()[0]
	if diff := cmp.Diff([]string{"gpu.tessera.dev/unmonitored=not-supported:None"}, taints(s)); diff != "" || s.Status != Unknown {
		t.Errorf("after recovery: status %s, taints (-want +got):\n%s", s.Status, diff)
	}
}
