package fakenode

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"

	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

// StateFile is where a fake node opened with Options.Persist keeps what
// the NVIDIA kernel driver would hold across processes, in its directory:
// each GPU's MIG mode and its GPU and compute instances (IDs, profiles,
// placements), its power limit and its compute mode. A real driver keeps them until the node reboots or the GPU
// is reset, whichever process made them; so a plugin started again in
// another process (a new plugin pod during an upgrade, over the same
// --fake-root) finds the partitions the old one created. Reboot clears
// them. The file names the profile that wrote it: a directory keeps one
// simulated node, as a node's driver keeps the state of its own GPUs.
const StateFile = "fake-nvml-state.json"

// savedState is StateFile's content.
type savedState struct {
	// Profile names the profile whose node wrote the file; files written
	// before it was recorded have none and are checked by GPU count alone.
	Profile string     `json:"profile,omitempty"`
	GPUs    []savedGPU `json:"gpus"`
}

type savedGPU struct {
	MigMode     int       `json:"migMode"`
	Instances   []savedGI `json:"gpuInstances,omitempty"`
	PowerMW     uint32    `json:"powerLimitMW"`
	ComputeMode int       `json:"computeMode"`
}

type savedGI struct {
	ID      uint32    `json:"id"`
	Profile uint32    `json:"profileId"`
	Start   uint32    `json:"start"`
	Size    uint32    `json:"size"`
	Compute []savedCI `json:"computeInstances,omitempty"`
}

type savedCI struct {
	ID      uint32 `json:"id"`
	Profile uint32 `json:"profileId"`
}

// persister writes the node's state to its StateFile after each change.
type persister struct {
	path     string
	profile  string
	devs     []*server.Device
	settings []*settings
	mu       sync.Mutex
	// err is the first failed write: the fake cannot keep its promise, and
	// Node.PersistError reports it to the test.
	err error
}

// save writes the devices' state now. Writes are serialised, and each
// writes the whole state as it is then, so the last one wins.
func (p *persister) save() {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	s := snapshot(p.devs, p.settings)
	s.Profile = p.profile
	if err := writeState(p.path, s); err != nil && p.err == nil {
		p.err = err
	}
}

// snapshot reads the devices' state, instances in ID order.
func snapshot(devs []*server.Device, settings []*settings) savedState {
	var s savedState
	for i, d := range devs {
		d.RLock()
		g := savedGPU{MigMode: d.MigMode}
		for gi := range d.GpuInstances {
			gi.RLock()
			sg := savedGI{ID: gi.Info.Id, Profile: gi.Info.ProfileId, Start: gi.Info.Placement.Start, Size: gi.Info.Placement.Size}
			for ci := range gi.ComputeInstances {
				sg.Compute = append(sg.Compute, savedCI{ID: ci.Info.Id, Profile: ci.Info.ProfileId})
			}
			gi.RUnlock()
			slices.SortFunc(sg.Compute, func(a, b savedCI) int { return int(a.ID) - int(b.ID) })
			g.Instances = append(g.Instances, sg)
		}
		d.RUnlock()
		slices.SortFunc(g.Instances, func(a, b savedGI) int { return int(a.ID) - int(b.ID) })
		st := settings[i]
		st.mu.Lock()
		g.PowerMW, g.ComputeMode = st.powerMW, int(st.computeMode)
		st.mu.Unlock()
		s.GPUs = append(s.GPUs, g)
	}
	return s
}

// writeState replaces the state file atomically.
func writeState(path string, s savedState) error {
	data, err := json.MarshalIndent(s, "", "  ")
	if err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		return fmt.Errorf("write the fake driver's state: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("write the fake driver's state: %w", err)
	}
	return nil
}

// readState reads the state file a node of the named profile with gpus
// GPUs left in dir; ok is false when there is none. A file another profile
// wrote is an error: its instances are another GPU model's.
func readState(dir, profile string, gpus int) (s savedState, ok bool, err error) {
	data, err := os.ReadFile(filepath.Join(dir, StateFile))
	if errors.Is(err, os.ErrNotExist) {
		return s, false, nil
	}
	if err != nil {
		return s, false, fmt.Errorf("read the fake driver's state: %w", err)
	}
	if err := json.Unmarshal(data, &s); err != nil {
		return s, false, fmt.Errorf("read the fake driver's state %s: %w", filepath.Join(dir, StateFile), err)
	}
	path := filepath.Join(dir, StateFile)
	if s.Profile != "" && s.Profile != profile {
		return s, false, fmt.Errorf("the fake driver's state %s belongs to a simulated %s node, not %s: give each profile its own directory, or remove the file to start afresh", path, s.Profile, profile)
	}
	if len(s.GPUs) != gpus {
		return s, false, fmt.Errorf("the fake driver's state %s has %d GPUs, the node %d: give each profile its own directory, or remove the file to start afresh", path, len(s.GPUs), gpus)
	}
	return s, true, nil
}

// PersistError is the first failed write of the node's state file, nil if
// none failed (or the node does not persist).
func (n *Node) PersistError() error {
	if n.persist == nil {
		return nil
	}
	n.persist.mu.Lock()
	defer n.persist.mu.Unlock()
	return n.persist.err
}

// GPUInstancesInState counts the GPU instances on each GPU in a state
// file's content (StateFile), for tests that read it where the node runs.
func GPUInstancesInState(data []byte) ([]int, error) {
	var s savedState
	if err := json.Unmarshal(data, &s); err != nil {
		return nil, fmt.Errorf("read the fake driver's state: %w", err)
	}
	out := make([]int, len(s.GPUs))
	for i, g := range s.GPUs {
		out[i] = len(g.Instances)
	}
	return out, nil
}
