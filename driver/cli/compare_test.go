package cli

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/tessera-dev/tessera/driver/discovery"
	"github.com/tessera-dev/tessera/driver/fakenode"
	"github.com/tessera-dev/tessera/driver/nodeopen"
)

// TestCompareFindsNoDifferenceOnTheModelItself: each simulated node compared
// with its own profile reports nothing, and comparing changes nothing on the
// GPUs (no state-changing NVML call).
func TestCompareFindsNoDifferenceOnTheModelItself(t *testing.T) {
	for _, name := range fakenode.Profiles() {
		t.Run(name, func(t *testing.T) {
			n, err := fakenode.New(name, fakenode.Options{Dir: t.TempDir(), NodeName: "node-a"})
			if err != nil {
				t.Fatal(err)
			}
			var out bytes.Buffer
			if err := InspectCompare(context.Background(), &out, nodeopen.Options{NodeName: "node-a", FakeNode: name, Opened: &n.Node}, name); err != nil {
				t.Fatal(err)
			}
			if !strings.HasSuffix(out.String(), "\nno differences\n") {
				t.Errorf("differences on the model itself:\n%s", out.String())
			}
			if c := n.Calls(); len(c) != 0 {
				t.Errorf("comparing changed the GPUs: %v", c)
			}
		})
	}
}

// TestCompareNamesEveryDifference: a node unlike its simulated profile (as
// a real DGX would be where the tables are wrong) gets one line per fact
// that differs.
func TestCompareNamesEveryDifference(t *testing.T) {
	real, err := fakenode.Lookup("dgx-h100")
	if err != nil {
		t.Fatal(err)
	}
	real.GPUs[3].BusID = "0000:5e:00.0"
	real.GPU.MemoryMiB = 81920
	for i, p := range real.GPU.MIG.Profiles {
		switch p.Name {
		case "1g.20gb":
			real.GPU.MIG.Profiles[i].Starts = []int{0, 1, 2, 3, 4, 5, 6}
			real.GPU.MIG.Profiles[i].Size = 1
		case "3g.40gb":
			real.GPU.MIG.Profiles[i].ID = 2
		}
	}
	n, err := fakenode.FromProfile(real, fakenode.Options{Dir: t.TempDir(), NodeName: "node-a"})
	if err != nil {
		t.Fatal(err)
	}
	gpus, err := discovery.Discover(context.Background(), &n.Node)
	if err != nil {
		t.Fatal(err)
	}
	sim, _ := fakenode.Lookup("dgx-h100")
	got := strings.Join(Compare(gpus, sim), "\n")
	for _, want := range []string{
		"gpu-3 PCI bus ID: node 0000:5e:00.0, simulated 0000:5d:00.0",
		"gpu-0 memory MiB: node 81920, simulated 81559",
		"gpu-0 MIG profile index 9 placements: node {0,1,2,3,4,5,6}:1, simulated {0,2,4,6}:2",
		"gpu-0 MIG profile index 2 NVML ID: node 2, simulated 9",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("missing %q in:\n%s", want, got)
		}
	}
}
