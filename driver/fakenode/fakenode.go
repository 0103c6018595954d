// Package fakenode simulates GPU nodes for tests and the demo. It builds on
// go-nvml's mock servers and completes what they leave out (PCI bus IDs, NUMA
// nodes, PCIe ancestry, NVLink state, GPU fabric membership, stable UUIDs), and
// lays out the host files a real node has beside NVML: sysfs PCI links,
// /proc/devices, the NVIDIA device nodes and the user-space driver. It is a peer
// of the real NVML behind gpulib.Node, never a branch in business logic.
package fakenode

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/gpus"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
	"github.com/google/uuid"

	"github.com/tessera-dev/tessera/driver/gpulib"
	"github.com/tessera-dev/tessera/driver/gpumodel"
)

// uuidSpace seeds the stable per-node GPU UUIDs.
var uuidSpace = uuid.MustParse("4f1c9a52-3d5e-4b7a-8e21-6c0d9f3b2a10")

// Node is a simulated GPU node.
type Node struct {
	gpulib.Node
	// Server is the go-nvml mock behind NVML, for tests that drive it.
	Server *server.Server
	// Profile is what the node was built from.
	Profile Profile
	// events injects GPU faults (events.go).
	events *events
	log    *callLog
	// settings are each GPU's power limit and compute mode.
	settings []*settings
	// persist keeps the MIG state in the node's directory (Options.Persist).
	persist *persister
}

// Options says where and as whom a fake node lives.
type Options struct {
	// Dir receives the node's host tree (sys/, proc/, dev/, the driver files).
	Dir string
	// NodeName seeds the GPU UUIDs, so two fake nodes never share a GPU UUID
	// and one node keeps its UUIDs across restarts.
	NodeName string
	// Clique overrides the profile's fabric as "<clusterUUID>.<cliqueID>", so
	// several trays can form one multi-node NVLink domain.
	Clique string
	// Persist keeps the GPUs' MIG state in Dir (StateFile) and starts from
	// what is there, as the kernel driver outlives the processes that use
	// it. A node opened by a plugin process (package nodeopen) persists.
	Persist bool
}

// New builds the named profile's node under opts.Dir.
func New(profileName string, opts Options) (*Node, error) {
	p, err := Lookup(profileName)
	if err != nil {
		return nil, err
	}
	if opts.Clique != "" {
		f, err := parseClique(opts.Clique)
		if err != nil {
			return nil, err
		}
		p.Fabric = f
	}
	return FromProfile(p, opts)
}

// FromProfile builds a node from a (possibly modified) profile.
func FromProfile(p Profile, opts Options) (*Node, error) {
	if opts.Dir == "" {
		return nil, fmt.Errorf("fake node %s: no directory for its host files", p.Name)
	}
	configs := gpus.Multiple(len(p.GPUs), mockConfig(p.GPU))
	srv := server.NewServerWithGPUs(p.DriverVersion, "12."+p.DriverVersion, p.CUDADriverVersion, configs...)
	island := islandOf(p)
	devs := make([]*server.Device, len(srv.Devices))
	for i, d := range srv.Devices {
		devs[i] = d.(*server.Device)
	}
	log := &callLog{}
	settings := make([]*settings, len(devs))
	var persist *persister
	saved, restore, err := savedState{}, false, error(nil)
	if opts.Persist {
		persist = &persister{path: filepath.Join(opts.Dir, StateFile), profile: p.Name, devs: devs, settings: settings}
		if err := os.MkdirAll(opts.Dir, 0o755); err != nil {
			return nil, fmt.Errorf("fake node %s: %w", p.Name, err)
		}
		if saved, restore, err = readState(opts.Dir, p.Name, len(devs)); err != nil {
			return nil, fmt.Errorf("fake node %s: %w", p.Name, err)
		}
	}
	changed := func() {}
	for i, d := range devs {
		d.UUID = "GPU-" + uuid.NewSHA1(uuidSpace, fmt.Appendf(nil, "%s/%s/%d", opts.NodeName, p.Name, i)).String()
		d.PciBusID = p.GPUs[i].BusID
		complete(d, i, p, devs, island)
		restoreMIG := completeMIG(d, i, p, log, func() string { return d.UUID }, func() { changed() })
		settings[i] = completeSettings(d, i, p, log, func() { changed() })
		switch {
		case restore:
			// The driver still holds what an earlier process made.
			if err := restoreMIG(saved.GPUs[i]); err != nil {
				return nil, fmt.Errorf("fake node %s: %w", p.Name, err)
			}
			settings[i].restore(saved.GPUs[i])
		case slices.Contains(p.MIGEnabled, i) || len(p.MIGInstances[i]) > 0:
			if err := createStatic(d, p.GPU.MIG, p.MIGInstances[i]); err != nil {
				return nil, fmt.Errorf("fake node %s: gpu-%d: %w", p.Name, i, err)
			}
		}
	}
	// A new process's call log starts empty, restored instances or not.
	log.calls = nil
	if persist != nil {
		changed = persist.save
		persist.save()
		if err := persist.err; err != nil {
			return nil, fmt.Errorf("fake node %s: %w", p.Name, err)
		}
	}
	if err := writeHostTree(opts.Dir, p, devs); err != nil {
		return nil, fmt.Errorf("fake node %s: write host tree: %w", p.Name, err)
	}
	return &Node{
		Node:     gpulib.Node{NVML: srv, HostRoot: opts.Dir, DriverRoot: opts.Dir, Profile: p.Name, Nodes: fileNodes{}},
		Server:   srv,
		Profile:  p,
		events:   attachEvents(srv, devs),
		log:      log,
		settings: settings,
		persist:  persist,
	}, nil
}

func islandOf(p Profile) map[int]int {
	m := map[int]int{}
	for n, is := range p.NVLinkIslands {
		for _, i := range is {
			m[i] = n
		}
	}
	return m
}

// complete fills in the mock functions go-nvml leaves unset (they panic).
func complete(d *server.Device, i int, p Profile, devs []*server.Device, island map[int]int) {
	pl := p.GPUs[i]
	d.GetPciInfoFunc = func() (nvml.PciInfo, nvml.Return) {
		var info nvml.PciInfo
		var domain, bus, dev, fn uint32
		fmt.Sscanf(pl.BusID, "%x:%x:%x.%x", &domain, &bus, &dev, &fn)
		info.Domain, info.Bus, info.Device = domain, bus, dev
		info.PciDeviceId = p.GPU.PCIDeviceID
		for j, c := range []byte(pl.BusID) {
			info.BusId[j] = int8(c)
		}
		for j, c := range []byte(pl.BusID[len(pl.BusID)-12:]) {
			info.BusIdLegacy[j] = int8(c)
		}
		return info, nvml.SUCCESS
	}
	d.GetNumaNodeIdFunc = func() (int, nvml.Return) { return pl.NUMANode, nvml.SUCCESS }
	myIsland, linked := island[i]
	d.GetNvLinkStateFunc = func(link int) (nvml.EnableState, nvml.Return) {
		if !linked || p.NVLinks == 0 {
			return nvml.FEATURE_DISABLED, nvml.ERROR_NOT_SUPPORTED
		}
		if link < 0 || link >= nvml.NVLINK_MAX_LINKS {
			return nvml.FEATURE_DISABLED, nvml.ERROR_INVALID_ARGUMENT
		}
		if link < p.NVLinks {
			return nvml.FEATURE_ENABLED, nvml.SUCCESS
		}
		return nvml.FEATURE_DISABLED, nvml.ERROR_NOT_SUPPORTED
	}
	peerIndex := func(other nvml.Device) int {
		for j, o := range devs {
			if nvml.Device(o) == other {
				return j
			}
		}
		return -1
	}
	d.GetP2PStatusFunc = func(other nvml.Device, caps nvml.GpuP2PCapsIndex) (nvml.GpuP2PStatus, nvml.Return) {
		j := peerIndex(other)
		if j < 0 {
			return nvml.P2P_STATUS_UNKNOWN, nvml.ERROR_INVALID_ARGUMENT
		}
		if caps == nvml.P2P_CAPS_INDEX_NVLINK {
			if theirs, ok := island[j]; ok && linked && theirs == myIsland && p.NVLinks > 0 {
				return nvml.P2P_STATUS_OK, nvml.SUCCESS
			}
			return nvml.P2P_STATUS_NOT_SUPPORTED, nvml.SUCCESS
		}
		return nvml.P2P_STATUS_OK, nvml.SUCCESS
	}
	d.GetTopologyCommonAncestorFunc = func(other nvml.Device) (nvml.GpuTopologyLevel, nvml.Return) {
		j := peerIndex(other)
		if j < 0 {
			return 0, nvml.ERROR_INVALID_ARGUMENT
		}
		o := p.GPUs[j]
		switch {
		case j == i:
			return nvml.TOPOLOGY_INTERNAL, nvml.SUCCESS
		case o.Switch == pl.Switch:
			return nvml.TOPOLOGY_SINGLE, nvml.SUCCESS
		case o.PCIeRoot == pl.PCIeRoot:
			return nvml.TOPOLOGY_HOSTBRIDGE, nvml.SUCCESS
		case o.NUMANode == pl.NUMANode:
			return nvml.TOPOLOGY_NODE, nvml.SUCCESS
		}
		return nvml.TOPOLOGY_SYSTEM, nvml.SUCCESS
	}
	d.GetGpuFabricInfoFunc = func() (nvml.GpuFabricInfo, nvml.Return) {
		if p.Fabric == nil {
			return nvml.GpuFabricInfo{}, nvml.ERROR_NOT_SUPPORTED
		}
		info := nvml.GpuFabricInfo{
			Status:   uint32(nvml.SUCCESS),
			CliqueId: p.Fabric.CliqueID,
			State:    nvml.GPU_FABRIC_STATE_COMPLETED,
		}
		u := uuid.MustParse(p.Fabric.ClusterUUID)
		copy(info.ClusterUuid[:], u[:])
		return info, nvml.SUCCESS
	}
	lim := powerLimits(p.GPU)
	d.GetPowerManagementLimitConstraintsFunc = func() (uint32, uint32, nvml.Return) {
		return lim.min, lim.max, nvml.SUCCESS
	}
	d.GetPowerManagementDefaultLimitFunc = func() (uint32, nvml.Return) {
		return lim.def, nvml.SUCCESS
	}
}

type limits struct{ min, max, def uint32 }

// powerLimits are the board's limits in milliwatts, as NVML reports them.
func powerLimits(m gpumodel.Model) limits {
	return limits{m.PowerMinW * 1000, m.PowerMaxW * 1000, m.PowerDefaultW * 1000}
}

func parseClique(s string) (*Fabric, error) {
	var cluster string
	var id uint32
	for i := len(s) - 1; i >= 0; i-- {
		if s[i] == '.' {
			cluster = s[:i]
			if _, err := fmt.Sscanf(s[i+1:], "%d", &id); err != nil {
				return nil, fmt.Errorf("fake clique %q: clique ID after the last '.' must be a number", s)
			}
			break
		}
	}
	if _, err := uuid.Parse(cluster); err != nil {
		return nil, fmt.Errorf("fake clique %q: want <clusterUUID>.<cliqueID>, cluster UUID invalid: %w", s, err)
	}
	return &Fabric{ClusterUUID: cluster, CliqueID: id}, nil
}

// mkfile writes a file, creating its directory.
func mkfile(path string, data string, mode os.FileMode) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	return os.WriteFile(path, []byte(data), mode)
}
