package cdi

import (
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestFindDriverFilesInEachLibDirLayout(t *testing.T) {
	for _, libDir := range []string{
		"usr/lib/x86_64-linux-gnu",
		"usr/lib64",
		"lib64",
		"usr/lib",
		"lib/x86_64-linux-gnu",
		"usr/lib/aarch64-linux-gnu",
	} {
		t.Run(libDir, func(t *testing.T) {
			root := t.TempDir()
			installDriver(t, root, libDir)
			got, err := FindDriverFiles(root)
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(Edits{Mounts: installedMounts(root, libDir)}, got); diff != "" {
				t.Errorf("FindDriverFiles (-want +got):\n%s", diff)
			}
		})
	}
}

func TestFindDriverFilesFollowsLinksInsideTheDriverRoot(t *testing.T) {
	tests := []struct {
		name  string
		setup func(t *testing.T, root string)
		want  []string // container paths
	}{{
		name: "merged /usr: lib64 links to usr/lib64, searched once",
		setup: func(t *testing.T, root string) {
			installDriver(t, root, "usr/lib64")
			symlink(t, root, "lib64", "usr/lib64")
			symlink(t, root, "bin", "usr/bin")
		},
		want: pathsOf(installedMounts("", "usr/lib64")),
	}, {
		name: "absolute link target is taken inside the driver root",
		setup: func(t *testing.T, root string) {
			writeFile(t, root, "usr/lib64/libnvidia-ml.so."+driverVersion)
			symlink(t, root, "usr/lib64/libnvidia-ml.so.1", "/usr/lib64/nvidia/libnvidia-ml.so.1")
			symlink(t, root, "usr/lib64/nvidia/libnvidia-ml.so.1", "../libnvidia-ml.so."+driverVersion)
		},
		want: []string{
			"/usr/lib64/libnvidia-ml.so.1",
			"/usr/lib64/libnvidia-ml.so." + driverVersion,
			"/usr/lib64/nvidia/libnvidia-ml.so.1",
		},
	}, {
		name: "unversioned install: no firmware lookup",
		setup: func(t *testing.T, root string) {
			writeFile(t, root, "usr/lib64/libnvidia-ml.so.1")
			writeFile(t, root, "lib/firmware/nvidia/"+driverVersion+"/gsp.bin")
		},
		want: []string{"/usr/lib64/libnvidia-ml.so.1"},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			root := t.TempDir()
			tt.setup(t, root)
			got, err := FindDriverFiles(root)
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(tt.want, pathsOf(got.Mounts)); diff != "" { // sorted, too
				t.Errorf("container paths (-want +got):\n%s", diff)
			}
			for _, m := range got.Mounts {
				if m.HostPath != root+m.ContainerPath {
					t.Errorf("mount %s: host path %s, want %s", m.ContainerPath, m.HostPath, root+m.ContainerPath)
				}
			}
		})
	}
}

func TestFindDriverFilesErrors(t *testing.T) {
	tests := []struct {
		name  string
		setup func(t *testing.T, root string)
		want  []string // substrings of the error
	}{{
		name:  "no driver at all",
		setup: func(t *testing.T, root string) { writeFile(t, root, "usr/lib64/libz.so.1") },
		want:  []string{"libnvidia-ml.so.1 not found", "--driver-root"},
	}, {
		name: "libcuda but no libnvidia-ml",
		setup: func(t *testing.T, root string) {
			writeFile(t, root, "usr/lib64/libcuda.so.1")
		},
		want: []string{"libnvidia-ml.so.1 not found", "--driver-root"},
	}, {
		name: "dangling link",
		setup: func(t *testing.T, root string) {
			writeFile(t, root, "usr/lib64/libnvidia-ml.so.1")
			symlink(t, root, "usr/lib64/libcuda.so.1", "libcuda.so."+driverVersion)
		},
		want: []string{"/usr/lib64/libcuda.so." + driverVersion, "link target of /usr/lib64/libcuda.so.1", "reinstall the driver"},
	}, {
		name: "link loop",
		setup: func(t *testing.T, root string) {
			symlink(t, root, "usr/lib64/libnvidia-ml.so.1", "libnvidia-ml.so.1")
		},
		want: []string{"more than 40 symlinks"},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			root := t.TempDir()
			tt.setup(t, root)
			_, err := FindDriverFiles(root)
			if err == nil {
				t.Fatal("no error")
			}
			for _, w := range append(tt.want, root) {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}
}

func pathsOf(mounts []Mount) []string {
	var paths []string
	for _, m := range mounts {
		paths = append(paths, m.ContainerPath)
	}
	return paths
}
