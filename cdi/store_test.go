package cdi

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"
)

func TestWriteProducesASpecTheLibraryAccepts(t *testing.T) {
	devRoot := t.TempDir()
	tests := []struct {
		name string
		spec ClaimSpec
	}{{
		name: "whole GPUs with control nodes and mounts",
		spec: gpuClaim(t, uidA, "train-0", devRoot, Edits{Mounts: []Mount{{"/driver/usr/bin/nvidia-smi", "/usr/bin/nvidia-smi"}}}, 0, 1),
	}, {
		name: "MIG device, node on another dev root",
		spec: ClaimSpec{
			ClaimUID: uidB, ClaimNamespace: "ml", ClaimName: "mig",
			Devices: []Device{{
				Name: "gpu-3-mig-1g.10gb-0",
				DeviceNodes: []DeviceNode{
					{Path: "/dev/nvidia3", HostPath: "/host/dev/nvidia3", Major: 195, Minor: 3},
					{Path: "/dev/nvidia-caps/nvidia-cap21", Major: 237, Minor: 21},
				},
			}},
		},
	}, {
		name: "device with env only, no common edits",
		spec: ClaimSpec{
			ClaimUID: "claim-1", ClaimNamespace: "default", ClaimName: "shared",
			Devices: []Device{{Name: "gpu-0", Env: []string{"CUDA_MPS_PIPE_DIRECTORY=/mps/0"}}},
		},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			store := newStore(t)
			ids, err := store.Write(tt.spec)
			if err != nil {
				t.Fatal(err)
			}
			spec, err := cdiapi.ReadSpec(store.Path(tt.spec.ClaimUID), 0)
			if err != nil {
				t.Fatalf("CDI library rejects the written spec: %v", err)
			}
			if spec.Kind != "gpu.tessera.dev/gpu" {
				t.Errorf("kind %q", spec.Kind)
			}
			// Annotations need 0.6.0; nothing we write needs more.
			if spec.Version != "0.6.0" {
				t.Errorf("CDI version %q, want 0.6.0", spec.Version)
			}
			wantIDs := map[string]string{}
			for _, d := range tt.spec.Devices {
				wantIDs[d.Name] = "gpu.tessera.dev/gpu=" + tt.spec.ClaimUID + "-" + d.Name
				if spec.GetDevice(tt.spec.ClaimUID+"-"+d.Name) == nil {
					t.Errorf("spec has no CDI device for %s", d.Name)
				}
			}
			if diff := cmp.Diff(wantIDs, ids); diff != "" {
				t.Errorf("ids (-want +got):\n%s", diff)
			}
			cache := newCache(t, store.dir) // fails on any spec error
			if got := cache.GetErrors(); len(got) != 0 {
				t.Errorf("cache errors: %v", got)
			}
		})
	}
}

func TestWriteLeavesOnlyTheSpecFileWithMode0644(t *testing.T) {
	store := newStore(t)
	spec := gpuClaim(t, uidA, "train-0", t.TempDir(), Edits{}, 0)
	for range 2 { // the second Write replaces the first
		if _, err := store.Write(spec); err != nil {
			t.Fatal(err)
		}
	}
	if got, want := dirNames(t, store.dir), []string{"gpu.tessera.dev-gpu_" + uidA + ".json"}; !slices.Equal(got, want) {
		t.Errorf("files in spec dir: %v, want %v", got, want)
	}
	fi, err := os.Stat(store.Path(uidA))
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode() != 0o644 {
		t.Errorf("mode %v, want -rw-r--r--", fi.Mode())
	}
}

func TestWriteRejectsBadSpecsAndWritesNothing(t *testing.T) {
	node := DeviceNode{Path: "/dev/nvidia0", Major: 195}
	good := func(edit func(*ClaimSpec)) ClaimSpec {
		c := ClaimSpec{
			ClaimUID: uidA, ClaimNamespace: "default", ClaimName: "train-0",
			Devices: []Device{{Name: "gpu-0", DeviceNodes: []DeviceNode{node}}},
		}
		edit(&c)
		return c
	}
	tests := []struct {
		name    string
		spec    ClaimSpec
		wantErr string
	}{
		{"empty claim UID", good(func(c *ClaimSpec) { c.ClaimUID = "" }), "empty claim UID"},
		{"claim UID with a slash", good(func(c *ClaimSpec) { c.ClaimUID = "a/../b" }), `character '/' not allowed`},
		{"claim UID ending in a dash", good(func(c *ClaimSpec) { c.ClaimUID = "abc-" }), "must start and end"},
		{"no claim name", good(func(c *ClaimSpec) { c.ClaimName = "" }), "empty claim name"},
		{"newline in namespace", good(func(c *ClaimSpec) { c.ClaimNamespace = "a\nb" }), "control character"},
		{"no devices", good(func(c *ClaimSpec) { c.Devices = nil }), "no devices"},
		{"device listed twice", good(func(c *ClaimSpec) { c.Devices = append(c.Devices, c.Devices[0]) }), `device "gpu-0" is listed twice`},
		{"device name with a space", good(func(c *ClaimSpec) { c.Devices[0].Name = "gpu 0" }), "bad device name"},
		{"device without edits", good(func(c *ClaimSpec) { c.Devices[0].DeviceNodes = nil }), "at least one edit"},
		{"env without =", good(func(c *ClaimSpec) { c.Devices[0].Env = []string{"FOO"} }), "KEY=VALUE"},
		{"relative node path", good(func(c *ClaimSpec) { c.Devices[0].DeviceNodes[0].Path = "dev/nvidia0" }), "clean absolute path"},
		{"unclean host path", good(func(c *ClaimSpec) { c.Devices[0].DeviceNodes[0].HostPath = "/host/../dev/nvidia0" }), "clean absolute path"},
		{"major 0 would make the runtime stat the node", good(func(c *ClaimSpec) { c.Devices[0].DeviceNodes[0].Major = 0 }), "major must be > 0"},
		{"negative minor", good(func(c *ClaimSpec) { c.Devices[0].DeviceNodes[0].Minor = -1 }), "minor >= 0"},
		{"relative mount", good(func(c *ClaimSpec) { c.Common.Mounts = []Mount{{"/usr/bin/nvidia-smi", "nvidia-smi"}} }), "common edits: mount container path"},
		{"invalid UTF-8 env", good(func(c *ClaimSpec) { c.Common.Env = []string{"A=\xff"} }), "not valid UTF-8"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			store := newStore(t)
			_, err := store.Write(tt.spec)
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("Write: %v, want error containing %q", err, tt.wantErr)
			}
			if tt.spec.ClaimUID != "" && !strings.Contains(err.Error(), tt.spec.ClaimUID) {
				t.Errorf("error %q does not name the claim", err)
			}
			if names := dirNames(t, store.dir); len(names) != 0 {
				t.Errorf("files left in spec dir: %v", names)
			}
		})
	}
}

func TestRemoveIsIdempotent(t *testing.T) {
	store := newStore(t)
	if _, err := store.Write(gpuClaim(t, uidA, "train-0", t.TempDir(), Edits{}, 0)); err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		if err := store.Remove(uidA); err != nil {
			t.Fatalf("Remove #%d: %v", i+1, err)
		}
		if names := dirNames(t, store.dir); len(names) != 0 {
			t.Fatalf("after Remove #%d: files %v", i+1, names)
		}
	}
	if err := store.Remove("../etc"); err == nil {
		t.Error("Remove of a malformed claim UID succeeded")
	}
}

func TestListRoundTripsAndIgnoresForeignFiles(t *testing.T) {
	devRoot := t.TempDir()
	store := newStore(t)
	driver := Edits{Mounts: []Mount{{"/driver/usr/bin/nvidia-smi", "/usr/bin/nvidia-smi"}}}
	want := []ClaimSpec{
		gpuClaim(t, uidA, "train-0", devRoot, driver, 0, 1),
		gpuClaim(t, uidB, "train-1", devRoot, driver, 2),
	}
	want[1].BootID = "5b0c2a4e-9d1f-4c1e-8a57-3f2e1d0c9b8a"
	// A record is the writer's business, read back byte for byte.
	want[1].Record = `{"claim":{"name":"train-1","devices":[{"device":"gpu-2"}]},"note":"\u00e9 \"quoted\" é <>&"}`
	for _, c := range slices.Backward(want) {
		if _, err := store.Write(c); err != nil {
			t.Fatal(err)
		}
	}
	foreign := `{"cdiVersion":"0.5.0","kind":"vendor.example/net","devices":[{"name":"eth0","containerEdits":{"env":["A=1"]}}]}`
	for name, data := range map[string]string{
		"vendor.example-net.json": foreign,
		"nvidia.com-gpu.yaml":     "not: [a spec",
		"README":                  "hello",
		".gpu.tessera.dev-gpu_" + uidA + ".json.tmp123": "partial",
	} {
		if err := os.WriteFile(filepath.Join(store.dir, name), []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := store.List()
	if err != nil {
		t.Fatalf("List: %v", err)
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("List (-written +read):\n%s", diff)
	}
}

func TestWriteRefusesARecordTheAnnotationsCannotCarry(t *testing.T) {
	store := newStore(t)
	spec := gpuClaim(t, uidA, "train-0", t.TempDir(), Edits{}, 0)
	for _, tt := range []struct{ record, want string }{
		{strings.Repeat("x", maxRecordLen+1), "more than the 131072"},
		{"a\nb", "control character"},
		{"\xff", "not valid UTF-8"},
	} {
		spec.Record = tt.record
		if _, err := store.Write(spec); err == nil || !strings.Contains(err.Error(), tt.want) || len(err.Error()) > 300 {
			t.Errorf("record of %d bytes: got %.300v, want a short error saying %q", len(tt.record), err, tt.want)
		}
	}
	if names := dirNames(t, store.dir); len(names) != 0 {
		t.Errorf("refused writes left %v", names)
	}
	spec.Record = strings.Repeat("x", maxRecordLen)
	if _, err := store.Write(spec); err != nil {
		t.Errorf("record of the largest size: %v", err)
	}
}

func TestListNamesOurBadFilesAndReturnsTheRest(t *testing.T) {
	store := newStore(t)
	good := gpuClaim(t, uidA, "train-0", t.TempDir(), Edits{}, 0)
	if _, err := store.Write(good); err != nil {
		t.Fatal(err)
	}
	// A valid spec of ours moved to another claim's file name.
	moved, err := os.ReadFile(store.Path(uidA))
	if err != nil {
		t.Fatal(err)
	}
	bad := map[string]string{
		store.Path("corrupt"): `{"cdiVersion":`,
		store.Path("moved"):   string(moved),
		store.Path("noannot"): `{"cdiVersion":"0.5.0","kind":"gpu.tessera.dev/gpu","devices":[{"name":"x","containerEdits":{"env":["A=1"]}}]}`,
	}
	for path, data := range bad {
		if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := store.List()
	if err == nil {
		t.Fatal("List: no error for bad files")
	}
	for path := range bad {
		if !strings.Contains(err.Error(), path) {
			t.Errorf("List error does not name %s:\n%v", path, err)
		}
	}
	if diff := cmp.Diff([]ClaimSpec{good}, got); diff != "" {
		t.Errorf("List (-want +got):\n%s", diff)
	}
}
