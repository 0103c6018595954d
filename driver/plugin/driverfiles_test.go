package plugin_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/tessera-dev/tessera/driver/fakenode"
	"github.com/tessera-dev/tessera/driver/nodeopen"
	"github.com/tessera-dev/tessera/driver/plugin"
)

// toolkitTools are the driver's tools NVIDIA's container toolkit mounts into
// every container. The IMEX service's nvidia-imex and nvidia-imex-ctl are not
// among them (they run beside the containers, not in them).
var toolkitTools = []string{"nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server"}

// driverFilesOnDisk lists what a driver root holds that NVIDIA's container
// toolkit gives a container asking for every capability (utility, compute,
// video, graphics): every file and soname link in the library directory,
// the GSP firmware directory of each version under lib/firmware/nvidia, the
// persistence daemon's socket and the tools above. It reads the directory
// itself; nothing of driver/driverfiles decides what is there.
func driverFilesOnDisk(t *testing.T, root, libDir string) []string {
	t.Helper()
	var out []string
	entries, err := os.ReadDir(filepath.Join(root, libDir))
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if strings.Contains(e.Name(), ".so") {
			out = append(out, "/"+libDir+"/"+e.Name())
		}
	}
	firmware, err := os.ReadDir(filepath.Join(root, "lib", "firmware", "nvidia"))
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range firmware {
		out = append(out, "/lib/firmware/nvidia/"+e.Name())
	}
	if _, err := os.Stat(filepath.Join(root, "run", "nvidia-persistenced", "socket")); err == nil {
		out = append(out, "/run/nvidia-persistenced/socket")
	}
	for _, tool := range toolkitTools {
		if _, err := os.Lstat(filepath.Join(root, "usr", "bin", tool)); err == nil {
			out = append(out, "/usr/bin/"+tool)
		}
	}
	slices.Sort(out)
	return out
}

// TestEveryProfilesSpecsMountEveryDriverFileItsRootHolds: for every simulated
// node, among them drivers whose versions have zero-padded parts
// (570.124.06, 550.90.07, 535.183.01), a claim asking for graphics is
// prepared through the plugin's socket and its CDI spec mounts every file
// the driver root holds for that version, each from the host's path, nothing
// left out.
func TestEveryProfilesSpecsMountEveryDriverFileItsRootHolds(t *testing.T) {
	for _, profile := range fakenode.Profiles() {
		t.Run(profile, func(t *testing.T) {
			p, err := fakenode.Lookup(profile)
			if err != nil {
				t.Fatal(err)
			}
			var root string
			h := startWith(t, func(dir string, o *plugin.Options) {
				root = filepath.Join(dir, "host")
				o.Node = nodeopen.Options{NodeName: nodeName, FakeNode: profile, FakeRoot: root}
				o.CDIHook = "/opt/tessera/bin/tessera-cdi-hook"
			})
			c := h.claimWithConfig("graphics", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","graphics":true}`, "gpu-0")
			if _, msg := h.prepare(c); msg != "" {
				t.Fatalf("prepare: %s", msg)
			}
			raw, err := os.ReadFile(filepath.Join(h.opts.CDIRoot, "gpu.tessera.dev-gpu_"+string(c.UID)+".json"))
			if err != nil {
				t.Fatal(err)
			}
			var spec struct {
				ContainerEdits struct {
					Mounts []struct {
						HostPath      string `json:"hostPath"`
						ContainerPath string `json:"containerPath"`
					} `json:"mounts"`
				} `json:"containerEdits"`
			}
			if err := json.Unmarshal(raw, &spec); err != nil {
				t.Fatal(err)
			}
			var mounted []string
			for _, m := range spec.ContainerEdits.Mounts {
				if m.HostPath != filepath.Join(root, m.ContainerPath) {
					t.Errorf("%s is mounted from %s, not from the driver root %s", m.ContainerPath, m.HostPath, root)
				}
				mounted = append(mounted, m.ContainerPath)
			}
			slices.Sort(mounted)
			want := driverFilesOnDisk(t, root, p.GPU.LibDir)
			if diff := cmp.Diff(want, mounted); diff != "" {
				t.Errorf("driver %s: the spec's mounts differ from the driver root's files (-root +spec):\n%s", p.DriverVersion, diff)
			}
		})
	}
}
