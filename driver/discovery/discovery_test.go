package discovery_test

import (
	"context"
	"strings"
	"testing"

	"github.com/tessera-dev/tessera/driver/discovery"
	"github.com/tessera-dev/tessera/driver/fakenode"
)

func discover(t *testing.T, profile string) []discovery.GPU {
	t.Helper()
	n, err := fakenode.New(profile, fakenode.Options{Dir: t.TempDir(), NodeName: "node-a"})
	if err != nil {
		t.Fatal(err)
	}
	gpus, err := discovery.Discover(context.Background(), &n.Node)
	if err != nil {
		t.Fatalf("discover %s: %v", profile, err)
	}
	return gpus
}

func TestDiscoveryOnEveryProfile(t *testing.T) {
	for _, tc := range []struct {
		profile      string
		count        int
		product      string
		arch         string
		cc           string
		driver       string
		memGiB       int64
		mig          bool
		nvlinkGroups int // distinct nvlinkDomain values
		pcieRoots    int
		clique       bool
	}{
		// Memory as NVML reports it (81559 MiB on an H100), not the
		// marketing size.
		{"dgx-a100", 8, "NVIDIA A100-SXM4-40GB", "Ampere", "8.0.0", "550.54.15", 40, true, 1, 4, false},
		{"dgx-a100-80gb", 8, "NVIDIA A100-SXM4-80GB", "Ampere", "8.0.0", "550.54.15", 80, true, 1, 4, false},
		{"dgx-h100", 8, "NVIDIA H100 80GB HBM3", "Hopper", "9.0.0", "550.54.15", 79, true, 1, 4, false},
		{"dgx-h200", 8, "NVIDIA H200", "Hopper", "9.0.0", "550.90.07", 140, true, 1, 4, false},
		{"dgx-b200", 8, "NVIDIA B200", "Blackwell", "10.0.0", "570.124.06", 179, true, 1, 4, false},
		{"gb200-nvl72-tray", 4, "NVIDIA GB200", "Blackwell", "10.0.0", "570.124.06", 185, true, 1, 4, true},
		{"pcie-l4x4", 4, "NVIDIA L4", "Ada Lovelace", "8.9.0", "535.183.01", 22, false, 4, 2, false},
	} {
		t.Run(tc.profile, func(t *testing.T) {
			gpus := discover(t, tc.profile)
			if len(gpus) != tc.count {
				t.Fatalf("got %d GPUs, want %d", len(gpus), tc.count)
			}
			domains, roots, uuids := map[string]bool{}, map[string]bool{}, map[string]bool{}
			for i, g := range gpus {
				if g.Index != i || g.Name() != "gpu-"+string(rune('0'+i)) {
					t.Errorf("GPU %d: index %d name %s", i, g.Index, g.Name())
				}
				if g.ProductName != tc.product || g.Architecture != tc.arch || g.CUDAComputeCapability != tc.cc || g.DriverVersion != tc.driver {
					t.Errorf("GPU %d: got %q %q cc %q driver %q", i, g.ProductName, g.Architecture, g.CUDAComputeCapability, g.DriverVersion)
				}
				if g.MemoryBytes>>30 != tc.memGiB {
					t.Errorf("GPU %d: memory %d GiB, want %d", i, g.MemoryBytes>>30, tc.memGiB)
				}
				if g.MIGCapable != tc.mig || g.MIGEnabled {
					t.Errorf("GPU %d: migCapable %v enabled %v, want capable %v and disabled", i, g.MIGCapable, g.MIGEnabled, tc.mig)
				}
				if !strings.HasPrefix(g.UUID, "GPU-") || uuids[g.UUID] {
					t.Errorf("GPU %d: UUID %q missing or repeated", i, g.UUID)
				}
				if g.PCIBusID == "" || g.PCIeRoot == "" || g.NUMANode == nil {
					t.Errorf("GPU %d: topology incomplete: bus %q root %q numa %v", i, g.PCIBusID, g.PCIeRoot, g.NUMANode)
				}
				if (g.NVLinkClique != "") != tc.clique {
					t.Errorf("GPU %d: clique %q, want one: %v", i, g.NVLinkClique, tc.clique)
				}
				if g.CUDADriverVersion == "" || g.PowerMaxWatts == 0 {
					t.Errorf("GPU %d: CUDA driver %q power max %d", i, g.CUDADriverVersion, g.PowerMaxWatts)
				}
				uuids[g.UUID] = true
				domains[g.NVLinkDomain] = true
				roots[g.PCIeRoot] = true
			}
			if len(domains) != tc.nvlinkGroups {
				t.Errorf("got %d NVLink domains, want %d: %v", len(domains), tc.nvlinkGroups, domains)
			}
			if len(roots) != tc.pcieRoots {
				t.Errorf("got %d PCIe roots, want %d: %v", len(roots), tc.pcieRoots, roots)
			}
		})
	}
}

func TestNVLinkIslandsSplitADGX(t *testing.T) {
	p, err := fakenode.Lookup("dgx-h100")
	if err != nil {
		t.Fatal(err)
	}
	p.NVLinkIslands = [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}}
	n, err := fakenode.FromProfile(p, fakenode.Options{Dir: t.TempDir(), NodeName: "split"})
	if err != nil {
		t.Fatal(err)
	}
	gpus, err := discovery.Discover(context.Background(), &n.Node)
	if err != nil {
		t.Fatal(err)
	}
	for i, g := range gpus {
		first := gpus[(i/4)*4].NVLinkDomain
		if g.NVLinkDomain != first {
			t.Errorf("gpu-%d domain %s, want its island's %s", i, g.NVLinkDomain, first)
		}
	}
	if gpus[0].NVLinkDomain == gpus[4].NVLinkDomain {
		t.Errorf("the two islands share domain %s", gpus[0].NVLinkDomain)
	}
}

func TestCliqueIsQualifiedByClusterUUID(t *testing.T) {
	gpus := discover(t, "gb200-nvl72-tray")
	if want := "7b2f0c5e-1d4a-4e8b-9c3f-0a6d5e4b3c21.1"; gpus[0].NVLinkClique != want {
		t.Errorf("clique %q, want %q", gpus[0].NVLinkClique, want)
	}
	n, err := fakenode.New("gb200-nvl72-tray", fakenode.Options{Dir: t.TempDir(), NodeName: "tray-2", Clique: "0f0e0d0c-0b0a-4908-8706-050403020100.7"})
	if err != nil {
		t.Fatal(err)
	}
	other, err := discovery.Discover(context.Background(), &n.Node)
	if err != nil {
		t.Fatal(err)
	}
	if other[3].NVLinkClique != "0f0e0d0c-0b0a-4908-8706-050403020100.7" {
		t.Errorf("overridden clique %q", other[3].NVLinkClique)
	}
	if _, err := fakenode.New("gb200-nvl72-tray", fakenode.Options{Dir: t.TempDir(), Clique: "not-a-uuid.1"}); err == nil {
		t.Error("a malformed clique was accepted")
	}
}

func TestUUIDsAreStablePerNodeAndDistinctAcrossNodes(t *testing.T) {
	a1, a2 := discover(t, "dgx-h100"), discover(t, "dgx-h100")
	n, err := fakenode.New("dgx-h100", fakenode.Options{Dir: t.TempDir(), NodeName: "node-b"})
	if err != nil {
		t.Fatal(err)
	}
	b, err := discovery.Discover(context.Background(), &n.Node)
	if err != nil {
		t.Fatal(err)
	}
	for i := range a1 {
		if a1[i].UUID != a2[i].UUID {
			t.Errorf("gpu-%d UUID changed between runs: %s vs %s", i, a1[i].UUID, a2[i].UUID)
		}
		if a1[i].UUID == b[i].UUID {
			t.Errorf("gpu-%d has the same UUID on two nodes", i)
		}
	}
}

func TestUnknownProfileListsTheKnownOnes(t *testing.T) {
	_, err := fakenode.New("dgx-z900", fakenode.Options{Dir: t.TempDir()})
	if err == nil || !strings.Contains(err.Error(), "dgx-h100") || !strings.Contains(err.Error(), "pcie-l4x4") {
		t.Fatalf("got %v, want an error listing the known profiles", err)
	}
}
