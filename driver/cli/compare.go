package cli

import (
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"

	"github.com/tessera-dev/tessera/driver/discovery"
	"github.com/tessera-dev/tessera/driver/fakenode"
	"github.com/tessera-dev/tessera/driver/gpumodel"
	"github.com/tessera-dev/tessera/driver/mig"
)

// Compare lists every difference between the GPUs discovered on a node and
// the simulated profile meant to stand for it: product, memory, power and
// versions of each GPU, its MIG profiles (index, NVML ID, name, instances,
// memory, engines, placements) and the node's topology (bus IDs, NUMA
// nodes, PCIe roots, NVLink islands, fabric clique). Discovery only reads
// NVML and sysfs, so comparing changes nothing on the node.
func Compare(gpus []discovery.GPU, p fakenode.Profile) []string {
	var out []string
	diff := func(what string, node, sim any) {
		if fmt.Sprint(node) != fmt.Sprint(sim) {
			out = append(out, fmt.Sprintf("%s: node %v, simulated %v", what, node, sim))
		}
	}
	m := p.GPU
	diff("GPU count", len(gpus), len(p.GPUs))
	domains := map[string]bool{}
	for i, g := range gpus {
		at := g.Name()
		diff(at+" product", strconv.Quote(g.ProductName), strconv.Quote(m.Product))
		diff(at+" memory MiB", g.MemoryBytes>>20, m.MemoryMiB)
		diff(at+" power min/max/default W", fmt.Sprintf("%d/%d/%d", g.PowerMinWatts, g.PowerMaxWatts, g.PowerDefaultWatts), fmt.Sprintf("%d/%d/%d", m.PowerMinW, m.PowerMaxW, m.PowerDefaultW))
		diff(at+" compute capability", g.CUDAComputeCapability, fmt.Sprintf("%d.%d.0", m.CUDAMajor, m.CUDAMinor))
		diff(at+" driver version", g.DriverVersion, p.DriverVersion)
		if i < len(p.GPUs) {
			pl := p.GPUs[i]
			diff(at+" PCI bus ID", g.PCIBusID, pl.BusID)
			diff(at+" PCIe root", g.PCIeRoot, pl.PCIeRoot)
			numa := "none"
			if g.NUMANode != nil {
				numa = strconv.Itoa(*g.NUMANode)
			}
			diff(at+" NUMA node", numa, pl.NUMANode)
		}
		domains[g.NVLinkDomain] = true
		diff(at+" in a multi-node NVLink clique", g.NVLinkClique != "", p.Fabric != nil)
		diff(at+" MIG capable", g.MIGCapable, m.MIG != nil)
		if m.MIG != nil && g.MIGCapable {
			diff(at+" switches MIG mode without a reset", g.MIGSwitchable, !m.MIG.ResetToSwitch)
			if g.MIG != nil {
				out = append(out, compareMIG(at, g.MIG, m.MIG)...)
			}
		}
	}
	islands := len(p.NVLinkIslands)
	inIsland := 0
	for _, is := range p.NVLinkIslands {
		inIsland += len(is)
	}
	islands += len(p.GPUs) - inIsland // a GPU without NVLink peers is a domain of its own
	diff("NVLink domains", len(domains), islands)
	return out
}

func compareMIG(at string, got *mig.Info, want *gpumodel.MIG) []string {
	var out []string
	diff := func(what string, node, sim any) {
		if fmt.Sprint(node) != fmt.Sprint(sim) {
			out = append(out, fmt.Sprintf("%s: node %v, simulated %v", what, node, sim))
		}
	}
	diff(at+" MIG memory slices", got.MemorySlices, want.MemorySlices)
	for _, w := range want.Profiles {
		g, ok := got.ProfileByIndex(w.Index)
		if !ok {
			out = append(out, fmt.Sprintf("%s MIG profile %s (index %d, ID %d): simulated only", at, w.Name, w.Index, w.ID))
			continue
		}
		p := fmt.Sprintf("%s MIG profile index %d", at, w.Index)
		diff(p+" name", g.Name, w.Name)
		diff(p+" NVML ID", g.NVMLID, w.ID)
		diff(p+" instances", g.MaxInstances, w.Instances)
		diff(p+" memory MiB", g.MemoryBytes>>20, w.MemoryMiB)
		diff(p+" SM/CE/DEC/ENC/JPEG/OFA", fmt.Sprintf("%d/%d/%d/%d/%d/%d", g.Multiprocessors, g.CopyEngines, g.Decoders, g.Encoders, g.JPEGs, g.OFAs),
			fmt.Sprintf("%d/%d/%d/%d/%d/%d", w.SMs, w.CopyEngines, w.Decoders, w.Encoders, w.JPEGs, w.OFAs))
		diff(p+" placements", placements(g.Placements), placements(toMIG(w.Placements())))
	}
	for _, g := range got.Profiles {
		if _, ok := want.ByIndex(g.Index); !ok {
			out = append(out, fmt.Sprintf("%s MIG profile %s (index %d, ID %d): node only", at, g.Name, g.Index, g.NVMLID))
		}
	}
	return out
}

func toMIG(pls []gpumodel.Placement) []mig.Placement {
	out := make([]mig.Placement, len(pls))
	for i, p := range pls {
		out[i] = mig.Placement{Start: p.Start, Size: p.Size}
	}
	return out
}

// placements prints placements as nvidia-smi mig -lgipp does: {0,2,4}:2.
func placements(pls []mig.Placement) string {
	bySize := map[int][]int{}
	for _, p := range pls {
		bySize[p.Size] = append(bySize[p.Size], p.Start)
	}
	sizes := make([]int, 0, len(bySize))
	for s := range bySize {
		sizes = append(sizes, s)
	}
	slices.Sort(sizes)
	var parts []string
	for _, s := range sizes {
		starts := bySize[s]
		slices.Sort(starts)
		strs := make([]string, len(starts))
		for i, st := range starts {
			strs[i] = strconv.Itoa(st)
		}
		parts = append(parts, "{"+strings.Join(strs, ",")+"}:"+strconv.Itoa(s))
	}
	return strings.Join(parts, " ")
}

// writeComparison prints a comparison's report: a header saying what was
// compared with what, then each difference, or that there is none.
func writeComparison(w io.Writer, header string, diffs []string) error {
	if _, err := fmt.Fprintln(w, header); err != nil {
		return err
	}
	if len(diffs) == 0 {
		_, err := fmt.Fprintln(w, "no differences")
		return err
	}
	for _, d := range diffs {
		if _, err := fmt.Fprintln(w, d); err != nil {
			return err
		}
	}
	return nil
}
