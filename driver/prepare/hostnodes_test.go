package prepare_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"

	"github.com/tessera-dev/tessera/driver/devnodes"
	"github.com/tessera-dev/tessera/driver/domain"
	"github.com/tessera-dev/tessera/driver/fakenode"
	"github.com/tessera-dev/tessera/driver/inventory"
)

// TestAPartitionsCapabilityNodesAreMadeAndRemoved: the MIG capability
// nodes a partition's container gets are made on the (simulated) host at
// prepare, with the numbers the spec names, and removed at unprepare.
func TestAPartitionsCapabilityNodesAreMadeAndRemoved(t *testing.T) {
	e := newEnv(t, "dgx-h100")
	m := e.start()
	ctx := context.Background()
	caps := []string{"dev/nvidia-caps/nvidia-cap3", "dev/nvidia-caps/nvidia-cap4"}
	for _, c := range caps {
		if _, err := os.Stat(filepath.Join(e.node.HostRoot, c)); err == nil {
			t.Fatalf("%s exists before any claim: the test proves nothing", c)
		}
	}
	if _, err := m.Prepare(ctx, claim("infer", part)); err != nil {
		t.Fatal(err)
	}
	for i, c := range caps {
		data, err := os.ReadFile(filepath.Join(e.node.HostRoot, c))
		if want := fmt.Sprintf("c %d:%d\n", fakenode.CapsMajor, 3+i); err != nil || string(data) != want {
			t.Errorf("%s: %q (%v), want a node %q", c, data, err, want)
		}
	}
	if err := m.Unprepare(ctx, "uid-infer"); err != nil {
		t.Fatal(err)
	}
	for _, c := range caps {
		if _, err := os.Stat(filepath.Join(e.node.HostRoot, c)); err == nil {
			t.Errorf("%s left after unprepare", c)
		}
	}
}

// TestNodesOfAClaimWithoutASpecAreReleasedAtStart: a crash between the
// spec's removal and the nodes' release leaves nodes; the start's sweep
// (as the plugin runs it) removes them and keeps a prepared claim's.
func TestNodesOfAClaimWithoutASpecAreReleasedAtStart(t *testing.T) {
	e := newEnv(t, "dgx-h100")
	m := e.start()
	ctx := context.Background()
	if _, err := m.Prepare(ctx, claim("kept", part)); err != nil {
		t.Fatal(err)
	}
	if _, err := m.Prepare(ctx, claim("crashed", "gpu-1-mig-1g10gb-6")); err != nil {
		t.Fatal(err)
	}
	specs := specFiles(t, e.cdiDir)
	crashed := slices.IndexFunc(specs, func(s string) bool { return strings.Contains(s, "uid-crashed") })
	if crashed < 0 {
		t.Fatalf("no spec of the crashed claim among %v", specs)
	}
	if err := os.Remove(specs[crashed]); err != nil {
		t.Fatal(err)
	}
	restarted := e.start()
	nodes := e.config().HostNodes
	if err := nodes.Sweep(ctx, restarted.HasSpec); err != nil {
		t.Fatal(err)
	}
	left, _ := filepath.Glob(filepath.Join(e.node.HostRoot, "dev/nvidia-caps/nvidia-cap*"))
	if len(left) != 2 {
		t.Errorf("capability nodes after the sweep: %v, want the kept claim's two", left)
	}
	records, _ := filepath.Glob(filepath.Join(nodes.Dir, "*.json"))
	if len(records) != 1 || filepath.Base(records[0]) != "uid-kept.json" {
		t.Errorf("records after the sweep: %v", records)
	}
}

// TestEveryModelsSpecHasTheDriverFiles: for every simulated model a whole
// GPU's container, and a MIG partition's where the model has MIG, get the
// utility and compute files of the model's driver layout, the video
// libraries for the engines the device has, no graphics libraries, and the
// hook that puts libcuda.so.1 in the loader cache, after injection through
// the CDI library as containerd does it.
func TestEveryModelsSpecHasTheDriverFiles(t *testing.T) {
	for _, name := range fakenode.Profiles() {
		t.Run(name, func(t *testing.T) {
			e := newEnv(t, name)
			m := e.start()
			p := e.node.Profile
			lib := "/" + p.GPU.LibDir + "/"
			type test struct {
				device string
				video  bool
			}
			tests := []test{{"gpu-0", true}}
			// The first partition of gpu-1 published, and one with
			// decoders where the first has none (A100's 1g.5gb).
			for _, d := range inventory.Build(e.gpus, inventory.Options{DynamicMIG: true}).Devices {
				if d.Kind != inventory.Partition || d.GPU.Index != 1 || (len(tests) == 2 && (d.Profile.Decoders == 0) == !tests[1].video) {
					continue
				}
				tests = append(tests, test{d.Name, d.Profile.Decoders > 0})
				if len(tests) == 3 {
					break
				}
			}
			for i, tt := range tests {
				devs, err := m.Prepare(context.Background(), claim(fmt.Sprint("c", i), tt.device))
				if err != nil {
					t.Fatal(err)
				}
				spec := inject(t, e.cdiDir, devs[0].CDIDeviceIDs...)
				var mounts []string
				for _, mt := range spec.Mounts {
					mounts = append(mounts, mt.Destination)
				}
				for _, want := range []string{lib + "libcuda.so.1", lib + "libcuda.so." + p.DriverVersion, lib + "libnvidia-ml.so.1",
					lib + "libnvidia-ptxjitcompiler.so.1", lib + "libnvidia-nvvm.so.4", lib + "libnvidia-gpucomp.so." + p.DriverVersion,
					lib + "libnvidia-allocator.so.1", "/usr/bin/nvidia-smi", "/usr/bin/nvidia-cuda-mps-control",
					"/lib/firmware/nvidia/" + p.DriverVersion, "/run/nvidia-persistenced/socket"} {
					if !slices.Contains(mounts, want) {
						t.Errorf("%s: mounts lack %s", tt.device, want)
					}
				}
				if got := slices.Contains(mounts, lib+"libnvcuvid.so.1"); got != tt.video {
					t.Errorf("%s: libnvcuvid.so.1 mounted %v, want %v", tt.device, got, tt.video)
				}
				if slices.Contains(mounts, lib+"libGLX_nvidia.so.0") {
					t.Errorf("%s: graphics libraries mounted, not asked for", tt.device)
				}
				if spec.Hooks == nil || len(spec.Hooks.CreateContainer) != 1 || spec.Hooks.CreateContainer[0].Path != testHook ||
					!slices.Contains(spec.Hooks.CreateContainer[0].Args, "--library="+lib+"libcuda.so.1") {
					t.Errorf("%s: hooks %+v, want tessera-cdi-hook putting libcuda.so.1 in the loader cache", tt.device, spec.Hooks)
				}
			}
		})
	}
}

// TestGangMembersShareTheirIMEXChannelNode: two members of a gang on an
// NVLink domain, on one node, get channel 3; its node is made on the host
// at the first prepare and removed when the last member is unprepared.
func TestGangMembersShareTheirIMEXChannelNode(t *testing.T) {
	e := newEnv(t, "gb200-nvl72-tray")
	m := e.start()
	ctx := context.Background()
	dev, err := devnodes.New(e.node.DevRoot(), e.node.HostRoot)
	if err != nil {
		t.Fatal(err)
	}
	p := e.domainPreparer()
	p.DevNodes = dev
	p.HostNodes = e.config().HostNodes
	member := func(name string) *resourceapi.ResourceClaim {
		c := domainClaim(name)
		c.Status.Allocation.Devices.Results[0].Pool = domain.PoolName(domain.KindNVLink, "4f1c9a52-3d5e-4b7a-8e21-6c0d9f3b2a10.7")
		c.Status.Allocation.Devices.Results[0].Device = domain.DeviceName(3)
		return c
	}
	node := filepath.Join(e.node.HostRoot, "dev/nvidia-caps-imex-channels/channel3")
	if _, err := os.Stat(node); err == nil {
		t.Fatal("channel3 exists before any claim: the test proves nothing")
	}
	for _, name := range []string{"member-0", "member-1"} {
		if _, err := m.PrepareDomain(ctx, member(name), p.Prepare); err != nil {
			t.Fatal(err)
		}
	}
	if data, err := os.ReadFile(node); err != nil || string(data) != fmt.Sprintf("c %d:3\n", fakenode.IMEXMajor) {
		t.Fatalf("channel3: %q (%v)", data, err)
	}
	if err := m.Unprepare(ctx, "uid-member-0"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(node); err != nil {
		t.Fatalf("channel3 went with the first member: %v", err)
	}
	if err := m.Unprepare(ctx, "uid-member-1"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(node); err == nil {
		t.Error("channel3 outlived the gang's last member on the node")
	}
}

// TestGraphicsOnlyWhenTheClaimAsks: a claim whose GpuConfig asks for
// graphics gets the OpenGL/EGL libraries and /dev/nvidia-modeset; one that
// does not, neither.
func TestGraphicsOnlyWhenTheClaimAsks(t *testing.T) {
	e := newEnv(t, "pcie-l4x4")
	m := e.start()
	lib := "/" + e.node.Profile.GPU.LibDir + "/"
	for _, tc := range []struct {
		name   string
		claim  *resourceapi.ResourceClaim
		wanted bool
	}{
		{"compute", claim("compute", "gpu-0"), false},
		{"graphics", withConfig(claim("graphics", "gpu-1"), driverName, `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","graphics":true}`), true},
		{"graphics off", withConfig(claim("off", "gpu-2"), driverName, `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","graphics":false}`), false},
	} {
		devs, err := m.Prepare(context.Background(), tc.claim)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		spec := inject(t, e.cdiDir, devs[0].CDIDeviceIDs...)
		var mounts, nodes []string
		for _, mt := range spec.Mounts {
			mounts = append(mounts, mt.Destination)
		}
		for _, d := range spec.Linux.Devices {
			nodes = append(nodes, fmt.Sprintf("%s %d:%d", d.Path, d.Major, d.Minor))
		}
		if got := slices.Contains(mounts, lib+"libGLX_nvidia.so.0") && slices.Contains(mounts, lib+"libnvidia-glcore.so."+e.node.Profile.DriverVersion); got != tc.wanted {
			t.Errorf("%s: graphics libraries mounted %v, want %v", tc.name, got, tc.wanted)
		}
		if got := slices.Contains(nodes, "/dev/nvidia-modeset 195:254"); got != tc.wanted {
			t.Errorf("%s: /dev/nvidia-modeset %v, want %v: %v", tc.name, got, tc.wanted, nodes)
		}
	}
}
