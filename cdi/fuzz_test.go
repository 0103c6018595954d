package cdi

import (
	"testing"

	"github.com/google/go-cmp/cmp"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"
)

// FuzzWriteSpec feeds arbitrary names, env, paths and records into Write.
// Write must never panic, and must either fail leaving the dir empty, or
// write a spec that the CDI library reads, injects, and List reads back
// unchanged.
func FuzzWriteSpec(f *testing.F) {
	f.Add(uidA, "default", "train-0", "gpu-3", "NVIDIA_VISIBLE_DEVICES=GPU-1", "/dev/nvidia3", "/host/dev/nvidia3", "/usr/bin/nvidia-smi", int64(195), int64(3), `{"claim":{"name":"train-0"}}`)
	f.Add(uidB, "ml", "mig", "gpu-3-mig-1g.10gb-0", "A=", "/dev/nvidia-caps/nvidia-cap21", "", "/lib/firmware/nvidia/550.54.15", int64(237), int64(21), "")
	f.Add("x", "n", "c", "0", "A=b=c", "/", "/", "/", int64(1), int64(0), "\u2028 \" '")
	f.Add("a/b", "", "", "", "=", "dev", "../x", "", int64(0), int64(-1), "\x00")
	f.Add("a", "n\x00", "c\u2028", "gpu:0", "A=\xff", "/dev//x", "/dev/./x", "/a/..", int64(-1), int64(1<<62), "\xff")
	f.Fuzz(func(t *testing.T, uid, ns, name, dev, env, nodePath, hostPath, mountPath string, major, minor int64, record string) {
		spec := ClaimSpec{
			ClaimUID: uid, ClaimNamespace: ns, ClaimName: name, Record: record,
			Devices: []Device{{
				Name:        dev,
				DeviceNodes: []DeviceNode{{Path: nodePath, HostPath: hostPath, Major: major, Minor: minor}},
				Env:         []string{env},
			}},
			Common: Edits{Env: []string{env}, Mounts: []Mount{{HostPath: mountPath, ContainerPath: mountPath}}},
		}
		store := newStore(t)
		ids, err := store.Write(spec)
		if err != nil {
			if names := dirNames(t, store.dir); len(names) != 0 {
				t.Fatalf("Write failed (%v) but left %v", err, names)
			}
			return
		}
		if _, err := cdiapi.ReadSpec(store.Path(uid), 0); err != nil {
			t.Fatalf("CDI library rejects what Write wrote: %v", err)
		}
		cache := newCache(t, store.dir)
		if _, err := cache.InjectDevices(emptyOCISpec(), ids[dev]); err != nil {
			t.Fatalf("inject %s: %v", ids[dev], err)
		}
		got, err := store.List()
		if err != nil {
			t.Fatalf("List: %v", err)
		}
		if diff := cmp.Diff([]ClaimSpec{spec}, got); diff != "" {
			t.Fatalf("List (-written +read):\n%s", diff)
		}
	})
}
