package mig_test

import (
	"fmt"
	"slices"
	"testing"

	"github.com/tessera-dev/tessera/driver/fakenode"
	"github.com/tessera-dev/tessera/driver/gpumodel"
	"github.com/tessera-dev/tessera/driver/mig"
	"github.com/tessera-dev/tessera/test/fixtures"
)

// TestReadNamesProfilesAsNVIDIADoes: what Tessera reads through NVML on each
// simulated model (profile index, NVML's unique ID, the name it derives,
// memory, engines, placements) is what the model's documented table says,
// names included where NVML's memory and the name disagree (an H200's
// 1g.18gb holds 16 GiB).
func TestReadNamesProfilesAsNVIDIADoes(t *testing.T) {
	for _, name := range fakenode.Profiles() {
		p, err := fakenode.Lookup(name)
		if err != nil {
			t.Fatal(err)
		}
		if p.GPU.MIG == nil {
			continue
		}
		t.Run(name, func(t *testing.T) {
			n, _ := fixtures.Node(t, p, "node-a")
			d, _ := n.Server.DeviceGetHandleByIndex(0)
			info, err := mig.Read(d)
			if err != nil {
				t.Fatal(err)
			}
			if info.MemorySlices != p.GPU.MIG.MemorySlices {
				t.Errorf("memory slices %d, want %d", info.MemorySlices, p.GPU.MIG.MemorySlices)
			}
			if len(info.Profiles) != len(p.GPU.MIG.Profiles) {
				t.Fatalf("read %d profiles, the table has %d", len(info.Profiles), len(p.GPU.MIG.Profiles))
			}
			for _, want := range p.GPU.MIG.Profiles {
				got, ok := info.ProfileByIndex(want.Index)
				if !ok {
					t.Errorf("profile %s (index %d) not read", want.Name, want.Index)
					continue
				}
				if g, w := describe(got), describeTable(want); g != w {
					t.Errorf("read:  %s\ntable: %s", g, w)
				}
			}
		})
	}
}

func describe(p mig.Profile) string {
	var starts []int
	size := 0
	for _, pl := range p.Placements {
		starts = append(starts, pl.Start)
		size = pl.Size
	}
	slices.Sort(starts)
	return fmt.Sprintf("%s index=%d id=%d mem=%dMiB sm=%d ce=%d dec=%d enc=%d jpeg=%d ofa=%d max=%d at %v:%d",
		p.Name, p.Index, p.NVMLID, p.MemoryBytes>>20, p.Multiprocessors, p.CopyEngines, p.Decoders, p.Encoders, p.JPEGs, p.OFAs, p.MaxInstances, starts, size)
}

func describeTable(p gpumodel.Profile) string {
	return fmt.Sprintf("%s index=%d id=%d mem=%dMiB sm=%d ce=%d dec=%d enc=%d jpeg=%d ofa=%d max=%d at %v:%d",
		p.Name, p.Index, p.ID, p.MemoryMiB, p.SMs, p.CopyEngines, p.Decoders, p.Encoders, p.JPEGs, p.OFAs, p.Instances, p.Starts, p.Size)
}
