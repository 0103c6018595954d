package discovery

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"sort"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"k8s.io/klog/v2"

	"github.com/tessera-dev/tessera/driver/checkpoint"
)

// The last-known file (Options.LastKnownPath) keeps a GPU in the node's
// slices after it falls off the bus while the plugin is down: NVML can no
// longer describe it, and leaving it out would make it vanish silently
// instead of showing up tainted. The contract:
//   - It holds, by NVML index, every GPU's description from its last
//     successful discovery. It is written atomically (mode 0600) after a
//     discovery, only when a description changed.
//   - A GPU NVML reports lost is described from it, with GPU.Lost set and the
//     node's current driver versions; its NVLink domain is the last-known one.
//     When NVML still tells the lost GPU's PCI bus ID and it differs from the
//     kept one (the hardware changed), the description is not used.
//   - A lost GPU the file does not know is left out, as before, and logged.
//   - A file that cannot be read is logged and ignored; the next discovery
//     replaces it.
//
// Callers must taint a GPU with Lost set (the health monitor's probe does):
// discovery only keeps it visible.

// lastKnownVersion is the last-known file's format version.
const lastKnownVersion = 1

type lastKnownFile struct {
	Version int   `json:"version"`
	GPUs    []GPU `json:"gpus"`
}

// lostGPU is a GPU NVML reported lost during discovery.
type lostGPU struct {
	index  int
	handle nvml.Device // nil when NVML gave none
	err    error
}

// describeLost returns the lost GPUs the last-known file describes, and
// records the GPUs read now in it. Failures are logged: the file only helps.
func describeLost(logger klog.Logger, path string, count int, read []GPU, lost []lostGPU, driverVersion, cudaVersion string) []GPU {
	if path == "" {
		for _, l := range lost {
			logger.Error(l.err, "GPU is lost, not publishing it", "index", l.index)
		}
		return nil
	}
	known, raw, err := readLastKnown(path)
	if err != nil {
		logger.Error(err, "Ignoring the GPUs' last-known descriptions; a GPU lost now is not published (the file is replaced after this discovery)")
		known, raw = map[int]GPU{}, nil
	}
	live := map[string]bool{}
	for _, g := range read {
		live[g.UUID] = true
	}
	var out []GPU
	for _, l := range lost {
		g, ok := known[l.index]
		if ok && live[g.UUID] {
			ok = false // its description is now another index's: the GPUs moved
		}
		if !ok {
			logger.Error(l.err, "GPU is lost and was never described on this node; not publishing it", "index", l.index)
			continue
		}
		if bus := busIDOf(l.handle); bus != "" && bus != g.PCIBusID {
			logger.Error(l.err, "GPU is lost and its PCI bus ID changed since it was last described; not publishing it", "index", l.index, "pciBusID", bus, "lastKnownPCIBusID", g.PCIBusID)
			continue
		}
		g.Lost = l.err.Error()
		g.DriverVersion, g.CUDADriverVersion = driverVersion, cudaVersion
		logger.Error(l.err, "GPU is lost; publishing its last-known description for the health monitor to taint", "device", g.Name(), "uuid", g.UUID)
		out = append(out, g)
	}
	for i := range known {
		if i < 0 || i >= count {
			delete(known, i)
		}
	}
	for _, g := range read {
		for i, k := range known {
			if k.UUID == g.UUID && i != g.Index {
				delete(known, i) // the GPU moved to another index
			}
		}
		known[g.Index] = g
	}
	if err := writeLastKnown(path, known, raw); err != nil {
		logger.Error(err, "Cannot keep the GPUs' last-known descriptions; a GPU lost before the next start will not be published")
	}
	return out
}

func busIDOf(h nvml.Device) string {
	if h == nil {
		return ""
	}
	pci, ret := h.GetPciInfo()
	if ret != nvml.SUCCESS {
		return ""
	}
	return normalizeBusID(pci)
}

// readLastKnown reads the file by GPU index; a missing file is empty. It
// returns the raw bytes too, so an unchanged file is not written again.
func readLastKnown(path string) (map[int]GPU, []byte, error) {
	raw, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return map[int]GPU{}, nil, nil
	}
	if err != nil {
		return nil, nil, fmt.Errorf("read last-known GPUs %s: %w", path, err)
	}
	var f lastKnownFile
	if err := json.Unmarshal(raw, &f); err != nil {
		return nil, nil, fmt.Errorf("decode last-known GPUs %s: %w", path, err)
	}
	if f.Version != lastKnownVersion {
		return nil, nil, fmt.Errorf("last-known GPUs %s have version %d, this plugin reads %d", path, f.Version, lastKnownVersion)
	}
	out := make(map[int]GPU, len(f.GPUs))
	for _, g := range f.GPUs {
		g.Lost = ""
		out[g.Index] = g
	}
	return out, raw, nil
}

func writeLastKnown(path string, known map[int]GPU, old []byte) error {
	f := lastKnownFile{Version: lastKnownVersion, GPUs: make([]GPU, 0, len(known))}
	for _, g := range known {
		f.GPUs = append(f.GPUs, g)
	}
	sort.Slice(f.GPUs, func(a, b int) bool { return f.GPUs[a].Index < f.GPUs[b].Index })
	raw, err := json.MarshalIndent(f, "", "  ")
	if err != nil {
		return fmt.Errorf("encode last-known GPUs: %w", err)
	}
	if bytes.Equal(raw, old) {
		return nil
	}
	return checkpoint.WriteFileAtomic(path, raw, 0o600)
}
