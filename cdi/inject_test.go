package cdi

import (
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	oci "github.com/opencontainers/runtime-spec/specs-go"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"
)

// newCache reads dir the way containerd does, refreshed only on demand.
func newCache(t *testing.T, dir string) *cdiapi.Cache {
	t.Helper()
	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(dir), cdiapi.WithAutoRefresh(false))
	if err != nil {
		t.Fatal(err)
	}
	if err := cache.Refresh(); err != nil {
		t.Fatalf("CDI cache refresh of %s: %v", dir, err)
	}
	return cache
}

func emptyOCISpec() *oci.Spec {
	return &oci.Spec{Linux: &oci.Linux{}, Process: &oci.Process{}}
}

// Expected OCI edits, written out independently of the code under test.
func ociNode(path string, major, minor int64) oci.LinuxDevice {
	return oci.LinuxDevice{Path: path, Type: "c", Major: major, Minor: minor}
}

func ociRule(major, minor int64) oci.LinuxDeviceCgroup {
	return oci.LinuxDeviceCgroup{Allow: true, Type: "c", Major: &major, Minor: &minor, Access: "rwm"}
}

func ociMounts(mounts []Mount) []oci.Mount {
	var out []oci.Mount
	for _, m := range mounts {
		out = append(out, oci.Mount{
			Destination: m.ContainerPath,
			Source:      m.HostPath,
			Type:        "bind",
			Options:     []string{"ro", "nosuid", "nodev", "rbind"},
		})
	}
	return out
}

// sorted compares OCI lists regardless of order: injection order is the
// runtime's business, the content is ours.
var sorted = cmp.Options{
	cmpopts.SortSlices(func(a, b oci.LinuxDevice) bool { return a.Path < b.Path }),
	cmpopts.SortSlices(func(a, b oci.Mount) bool { return a.Destination < b.Destination }),
	cmpopts.SortSlices(func(a, b oci.LinuxDeviceCgroup) bool {
		return *a.Major < *b.Major || *a.Major == *b.Major && *a.Minor < *b.Minor
	}),
	cmpopts.SortSlices(func(a, b string) bool { return a < b }),
}

func TestInjectionAsContainerdDoesIt(t *testing.T) {
	devRoot := t.TempDir()
	driverRoot := t.TempDir()
	driver := driverEdits(driverRoot)
	store := newStore(t)
	idsA, err := store.Write(gpuClaim(t, uidA, "train-0", devRoot, driver, 0, 1))
	if err != nil {
		t.Fatal(err)
	}
	idsB, err := store.Write(gpuClaim(t, uidB, "train-1", devRoot, driver, 2))
	if err != nil {
		t.Fatal(err)
	}
	control := []oci.LinuxDevice{
		ociNode("/dev/nvidiactl", 195, 255),
		ociNode("/dev/nvidia-uvm", 508, 0),
		ociNode("/dev/nvidia-uvm-tools", 508, 1),
	}
	controlRules := []oci.LinuxDeviceCgroup{ociRule(195, 255), ociRule(508, 0), ociRule(508, 1)}

	tests := []struct {
		name      string
		ids       []string
		wantNodes []oci.LinuxDevice
		wantRules []oci.LinuxDeviceCgroup
		wantEnv   []string
		claims    int // how many claims the devices come from
	}{{
		name:      "one device of a claim brings its node and the claim's common edits",
		ids:       []string{idsA["gpu-0"]},
		wantNodes: append(control, ociNode("/dev/nvidia0", 195, 0)),
		wantRules: append(controlRules, ociRule(195, 0)),
		wantEnv:   []string{"NVIDIA_VISIBLE_DEVICES=GPU-train-0", "TESSERA_GPU_0=train-0"},
		claims:    1,
	}, {
		name:      "two devices of a claim apply the common edits once",
		ids:       []string{idsA["gpu-0"], idsA["gpu-1"]},
		wantNodes: append(control, ociNode("/dev/nvidia0", 195, 0), ociNode("/dev/nvidia1", 195, 1)),
		wantRules: append(controlRules, ociRule(195, 0), ociRule(195, 1)),
		wantEnv:   []string{"NVIDIA_VISIBLE_DEVICES=GPU-train-0", "TESSERA_GPU_0=train-0", "TESSERA_GPU_1=train-0"},
		claims:    1,
	}, {
		// Node paths and mounts are de-duplicated by the library, cgroup
		// rules are not (duplicates are harmless), and a claim-level env
		// key set by both claims takes the value of the claim injected
		// last: claim-level env must not be relied on to add up.
		name:      "two claims in one container both apply",
		ids:       []string{idsA["gpu-0"], idsB["gpu-2"]},
		wantNodes: append(control, ociNode("/dev/nvidia0", 195, 0), ociNode("/dev/nvidia2", 195, 2)),
		wantRules: append(append(controlRules, controlRules...), ociRule(195, 0), ociRule(195, 2)),
		wantEnv:   []string{"NVIDIA_VISIBLE_DEVICES=GPU-train-1", "TESSERA_GPU_0=train-0", "TESSERA_GPU_2=train-1"},
		claims:    2,
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cache := newCache(t, store.dir)
			got := emptyOCISpec()
			if unresolved, err := cache.InjectDevices(got, tt.ids...); err != nil {
				t.Fatalf("InjectDevices(%v): unresolved %v: %v", tt.ids, unresolved, err)
			}
			want := &oci.Spec{
				Process: &oci.Process{Env: tt.wantEnv},
				Linux: &oci.Linux{
					Devices:   tt.wantNodes,
					Resources: &oci.LinuxResources{Devices: tt.wantRules},
				},
				Mounts: ociMounts(driverEdits(driverRoot).Mounts),
				// Hooks are not de-duplicated: the hook runs once per
				// claim, and must be idempotent. Its timeout reaches the
				// runtime, which kills a hook that outlives it.
				Hooks: &oci.Hooks{CreateContainer: slices.Repeat([]oci.Hook{{
					Path:    "/var/lib/kubelet/plugins/gpu.tessera.dev/bin/tessera-cdi-hook",
					Args:    []string{"tessera-cdi-hook", "update-ldcache", "--library=/usr/lib/x86_64-linux-gnu/libcuda.so.1"},
					Timeout: ptr(10),
				}}, tt.claims)},
			}
			if diff := cmp.Diff(want, got, sorted); diff != "" {
				t.Errorf("injected OCI spec (-want +got):\n%s", diff)
			}
		})
	}
}

func TestInjectingAnUnknownDeviceFails(t *testing.T) {
	store := newStore(t)
	ids, err := store.Write(gpuClaim(t, uidA, "train-0", t.TempDir(), Edits{}, 0))
	if err != nil {
		t.Fatal(err)
	}
	cache := newCache(t, store.dir)
	for _, id := range []string{
		DeviceID(uidA, "gpu-7"),
		DeviceID(uidB, "gpu-0"),
		"gpu.tessera.dev/gpu=gpu-0", // the bare driver name is never a CDI name
	} {
		unresolved, err := cache.InjectDevices(emptyOCISpec(), ids["gpu-0"], id)
		if err == nil || !cmp.Equal(unresolved, []string{id}) {
			t.Errorf("InjectDevices(%s) = %v, %v; want it unresolved and an error", id, unresolved, err)
		}
	}
}

func TestRemovedDeviceCanNoLongerBeInjected(t *testing.T) {
	store := newStore(t)
	ids, err := store.Write(gpuClaim(t, uidA, "train-0", t.TempDir(), Edits{}, 0))
	if err != nil {
		t.Fatal(err)
	}
	cache := newCache(t, store.dir)
	if _, err := cache.InjectDevices(emptyOCISpec(), ids["gpu-0"]); err != nil {
		t.Fatalf("before Remove: %v", err)
	}
	if err := store.Remove(uidA); err != nil {
		t.Fatal(err)
	}
	if err := cache.Refresh(); err != nil {
		t.Fatal(err)
	}
	_, err = cache.InjectDevices(emptyOCISpec(), ids["gpu-0"])
	if err == nil || !strings.Contains(err.Error(), "unresolvable") {
		t.Errorf("after Remove: InjectDevices = %v, want unresolvable", err)
	}
}

func ptr[T any](v T) *T { return &v }
