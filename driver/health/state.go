package health

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"

	"github.com/tessera-dev/tessera/driver/checkpoint"
)

// The health state file (Options.StatePath) keeps what the monitor cannot
// re-derive after a restart: a GPU that threw XID 48 answers probes, so
// without the file it would come back healthy at once. The contract:
//   - It holds, by GPU UUID, every GPU carrying a fault taint: its taints with
//     their TimeAdded (the unmonitored mark is left out: Start re-derives it)
//     and its last fault, rounded up to the second.
//   - It is written atomically (checkpoint.WriteFileAtomic, mode 0600) only
//     when its content changes: at most once a second during an XID storm,
//     once a probe interval while a GPU stays lost, never while all is well.
//   - Restored taints stay until the ordinary rule lifts them: a quiet period
//     since the last fault, then a passing probe.
//   - A file that cannot be read or has an unknown version is logged and
//     ignored (the monitor starts from probes alone, never crash-loops); a
//     UUID no GPU of the node has is dropped.

// stateVersion is the state file's format version.
const stateVersion = 1

type stateFile struct {
	Version int                 `json:"version"`
	GPUs    map[string]savedGPU `json:"gpus"`
}

// savedGPU is the part of one GPU's health that survives a restart.
type savedGPU struct {
	Taints    []resourceapi.DeviceTaint `json:"taints"`
	LastFault time.Time                 `json:"lastFault"`
}

// restorable are the taint keys a state file may bring back.
var restorable = map[string]bool{KeyXID: true, KeyECC: true, KeyLost: true}

// saved returns the persisted form of every GPU with a fault taint, by UUID.
func (m *machine) saved() map[string]savedGPU {
	out := map[string]savedGPU{}
	for _, d := range m.devices {
		if d.uuid == "" || !d.faulty() {
			continue
		}
		s := savedGPU{LastFault: ceilSecond(d.lastFault)}
		for _, t := range d.taints {
			if restorable[t.Key] {
				s.Taints = append(s.Taints, t)
			}
		}
		sortTaints(s.Taints)
		out[d.uuid] = s
	}
	return out
}

// restore brings back a GPU's saved taints and last fault; it says false
// when no GPU has the UUID. A last fault in the future (the clock went back)
// counts as now.
func (m *machine) restore(uuid string, s savedGPU, now time.Time) bool {
	for _, d := range m.devices {
		if d.uuid != uuid {
			continue
		}
		for _, t := range s.Taints {
			if !restorable[t.Key] {
				continue
			}
			if t.TimeAdded == nil {
				at := metav1.NewTime(now.Truncate(time.Second))
				t.TimeAdded = &at
			}
			d.taints[t.Key] = t
		}
		d.lastFault = s.LastFault
		if d.lastFault.After(now) {
			d.lastFault = now
		}
		d.update(now)
		return true
	}
	return false
}

func ceilSecond(t time.Time) time.Time {
	r := t.Truncate(time.Second)
	if r.Before(t) {
		r = r.Add(time.Second)
	}
	return r
}

// readState reads a state file; a missing one is empty. It returns the raw
// bytes too, so an unchanged state is not written again.
func readState(path string) (stateFile, []byte, error) {
	raw, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return stateFile{}, nil, nil
	}
	if err != nil {
		return stateFile{}, nil, fmt.Errorf("read health state %s: %w", path, err)
	}
	var f stateFile
	if err := json.Unmarshal(raw, &f); err != nil {
		return stateFile{}, nil, fmt.Errorf("decode health state %s: %w", path, err)
	}
	if f.Version != stateVersion {
		return stateFile{}, nil, fmt.Errorf("health state %s has version %d, this plugin reads %d", path, f.Version, stateVersion)
	}
	return f, raw, nil
}

// restoreState loads the state file into the machine. The caller holds mu.
func (mon *Monitor) restoreState(logger klog.Logger, now time.Time) {
	if mon.opts.StatePath == "" {
		return
	}
	f, raw, err := readState(mon.opts.StatePath)
	if err != nil {
		logger.Error(err, "Ignoring the saved GPU health state; health is re-derived from probes and new events (the file is replaced at the next change)")
		return
	}
	mon.written = raw
	for uuid, s := range f.GPUs {
		if !mon.machine.restore(uuid, s, now) {
			logger.Info("Saved health state names a GPU this node does not have; dropped", "uuid", uuid)
			continue
		}
		logger.Info("Restored GPU health from before the restart", "uuid", uuid, "taints", len(s.Taints), "lastFault", s.LastFault)
	}
}

// saveState writes the state file when its content changed. A failed write is
// logged and tried again at the next change or probe. The caller holds mu.
func (mon *Monitor) saveState(logger klog.Logger) {
	if mon.opts.StatePath == "" {
		return
	}
	gpus := mon.machine.saved()
	if mon.written == nil && len(gpus) == 0 {
		return // no file and nothing to keep
	}
	raw, err := json.MarshalIndent(stateFile{Version: stateVersion, GPUs: gpus}, "", "  ")
	if err != nil {
		logger.Error(err, "Cannot encode GPU health state")
		return
	}
	if bytes.Equal(raw, mon.written) {
		return
	}
	if err := checkpoint.WriteFileAtomic(mon.opts.StatePath, raw, 0o600); err != nil {
		logger.Error(err, "Cannot save GPU health state; a restart now would forget the GPUs' taints until they fault again", "path", mon.opts.StatePath)
		return
	}
	mon.written = raw
}
