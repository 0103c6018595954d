package gpumodel

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestTablesMatchTheirSources checks each model's table against the facts
// its sources print (testdata/<key>.txt, transcribed separately): product,
// memory, power and PCI ID, and for MIG boards every profile's name, ID,
// instance count, memory as nvidia-smi rounds it, SMs and engines, and its
// placements. Every profile of the table must appear in the source and
// every profile of the source in the table.
func TestTablesMatchTheirSources(t *testing.T) {
	for _, key := range Keys() {
		t.Run(key, func(t *testing.T) {
			m, err := Lookup(key)
			if err != nil {
				t.Fatal(err)
			}
			if len(m.Sources) == 0 {
				t.Errorf("%s names no source", key)
			}
			f, err := os.Open(filepath.Join("testdata", key+".txt"))
			if err != nil {
				t.Fatalf("no source facts for %s: %v", key, err)
			}
			defer f.Close()
			seen := map[int]bool{}
			placed := map[int]bool{}
			sc := bufio.NewScanner(f)
			for sc.Scan() {
				line := strings.TrimSpace(sc.Text())
				if line == "" || strings.HasPrefix(line, "#") {
					continue
				}
				fields := strings.Fields(line)
				switch fields[0] {
				case "product":
					name, rest, _ := strings.Cut(strings.TrimPrefix(line, "product \""), "\" ")
					var mem uint64
					var pmin, pmax, pdef uint32
					var pci uint32
					if _, err := fmt.Sscanf(rest, "%d %d/%d/%d 0x%x", &mem, &pmin, &pmax, &pdef, &pci); err != nil {
						t.Fatalf("bad product line %q: %v", line, err)
					}
					got := fmt.Sprintf("%q %d MiB %d/%d/%d W 0x%04x", m.Product, m.MemoryMiB, m.PowerMinW, m.PowerMaxW, m.PowerDefaultW, m.PCIDeviceID>>16)
					want := fmt.Sprintf("%q %d MiB %d/%d/%d W 0x%04x", name, mem, pmin, pmax, pdef, pci)
					if got != want {
						t.Errorf("table: %s\nsource: %s", got, want)
					}
				case "lgip":
					if len(fields) < 11 {
						t.Fatalf("bad lgip line %q", line)
					}
					id := atoi(t, fields[2])
					p, ok := m.MIG.ByID(id)
					if !ok {
						t.Errorf("source has profile %s (ID %d), the table does not", fields[1], id)
						continue
					}
					seen[id] = true
					got := fmt.Sprintf("%s id=%d instances=%d mem=%.2fGiB sm=%d dec=%d enc=%d ce=%d jpeg=%d ofa=%d",
						p.Name, p.ID, p.Instances, float64(p.MemoryMiB)/1024, p.SMs, p.Decoders, p.Encoders, p.CopyEngines, p.JPEGs, p.OFAs)
					want := fmt.Sprintf("%s id=%s instances=%s mem=%sGiB sm=%s dec=%s enc=%s ce=%s jpeg=%s ofa=%s",
						fields[1], fields[2], fields[3], fields[4], fields[5], fields[6], fields[7], fields[8], fields[9], fields[10])
					if got != want {
						t.Errorf("table:  %s\nsource: %s", got, want)
					}
				case "lgipp":
					id := atoi(t, fields[1])
					p, ok := m.MIG.ByID(id)
					if !ok {
						t.Errorf("source places profile ID %d, the table has no such profile", id)
						continue
					}
					placed[id] = true
					got := fmt.Sprintf("{%s}:%d", strings.Trim(strings.Join(strings.Fields(fmt.Sprint(p.Starts)), ","), "[]"), p.Size)
					if got != fields[2] {
						t.Errorf("profile %s placements: table %s, source %s", p.Name, got, fields[2])
					}
				default:
					t.Fatalf("unknown line %q", line)
				}
			}
			if err := sc.Err(); err != nil {
				t.Fatal(err)
			}
			if m.MIG == nil {
				return
			}
			for _, p := range m.MIG.Profiles {
				if !seen[p.ID] || !placed[p.ID] {
					t.Errorf("table profile %s (ID %d) is missing from the source (lgip %v, lgipp %v)", p.Name, p.ID, seen[p.ID], placed[p.ID])
				}
			}
		})
	}
}

func atoi(t *testing.T, s string) int {
	t.Helper()
	n, err := strconv.Atoi(s)
	if err != nil {
		t.Fatalf("not a number: %q", s)
	}
	return n
}

// TestTablesAreConsistent checks what the documented MIG rules say of every
// table: placements lie within the memory slices, each profile's size is
// the same at every start, NVML indexes and IDs are each unique, and the
// whole-GPU profile spans every slice.
func TestTablesAreConsistent(t *testing.T) {
	for _, key := range Keys() {
		m, _ := Lookup(key)
		if m.MIG == nil {
			continue
		}
		index, id, name := map[int]bool{}, map[int]bool{}, map[string]bool{}
		for _, p := range m.MIG.Profiles {
			if index[p.Index] || id[p.ID] || name[p.Name] {
				t.Errorf("%s: profile %s repeats an index, ID or name", key, p.Name)
			}
			index[p.Index], id[p.ID], name[p.Name] = true, true, true
			for _, s := range p.Starts {
				if s < 0 || s+p.Size > m.MIG.MemorySlices {
					t.Errorf("%s: %s at %d (size %d) leaves the %d memory slices", key, p.Name, s, p.Size, m.MIG.MemorySlices)
				}
			}
			if p.Slices == 7 && (p.Size != m.MIG.MemorySlices || len(p.Starts) != 1) {
				t.Errorf("%s: the 7g profile does not span the GPU", key)
			}
		}
	}
}
