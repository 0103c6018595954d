package prepare_test

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/google/go-cmp/cmp"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/fakenode"
	"github.com/tessera-dev/tessera/driver/mig"
)

const part = "gpu-0-mig-1g10gb-6" // 1g.10gb (profile index 0, NVML ID 19) at placement 6 on gpu-0

func TestPrepareCreatesAndUnprepareDestroysAPartition(t *testing.T) {
	e := newEnv(t, "dgx-h100")
	m := e.start()
	ctx := context.Background()
	e.node.ResetCalls()
	devs, err := m.Prepare(ctx, claim("infer", part))
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"gpu-0 SetMigMode(1)", "gpu-0 CreateGpuInstance(profile=19 start=6)", "gpu-0 CreateComputeInstance(gi=0 profile=0)"}
	if diff := cmp.Diff(want, e.node.Calls()); diff != "" {
		t.Errorf("NVML calls at prepare (-want +got):\n%s", diff)
	}
	spec := inject(t, e.cdiDir, devs[0].CDIDeviceIDs...)
	var nodes []string
	for _, d := range spec.Linux.Devices {
		nodes = append(nodes, d.Path)
	}
	for _, n := range []string{"/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap3", "/dev/nvidia-caps/nvidia-cap4", "/dev/nvidiactl"} {
		if !slices.Contains(nodes, n) {
			t.Errorf("container lacks %s: %v", n, nodes)
		}
	}
	if env := strings.Join(spec.Process.Env, " "); !strings.Contains(env, "NVIDIA_VISIBLE_DEVICES=MIG-") {
		t.Errorf("env does not name the MIG device: %s", env)
	}
	if n := e.node.GPUInstances(0); n != 1 {
		t.Fatalf("%d GPU instances after prepare", n)
	}
	e.node.ResetCalls()
	if err := m.Unprepare(ctx, "uid-infer"); err != nil {
		t.Fatal(err)
	}
	want = []string{"gpu-0 DestroyComputeInstance(gi=0 ci=0)", "gpu-0 DestroyGpuInstance(profile=19 start=6)", "gpu-0 SetMigMode(0)"}
	if diff := cmp.Diff(want, e.node.Calls()); diff != "" {
		t.Errorf("NVML calls at unprepare (-want +got):\n%s", diff)
	}
	if n := e.node.GPUInstances(0); n != 0 {
		t.Errorf("%d GPU instances after unprepare", n)
	}
	// The whole GPU is usable again.
	if _, err := m.Prepare(ctx, claim("whole", "gpu-0")); err != nil {
		t.Fatal(err)
	}
}

func TestPartitionsOfOneGPUPrepareSideBySide(t *testing.T) {
	e := newEnv(t, "dgx-h100")
	m := e.start()
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i, dev := range []string{"gpu-1-mig-1g10gb-0", "gpu-1-mig-1g10gb-1", "gpu-1-mig-2g20gb-2", "gpu-1-mig-3g40gb-4"} {
		wg.Go(func() { _, errs[i] = m.Prepare(context.Background(), claim(dev, dev)) })
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("partition %d: %v", i, err)
		}
	}
	if n := e.node.GPUInstances(1); n != 4 {
		t.Errorf("%d GPU instances, want 4", n)
	}
}

func TestAnInterruptedMIGPrepareIsRolledBack(t *testing.T) {
	for _, created := range []bool{true, false} {
		e := newEnv(t, "dgx-h100")
		if _, err := e.start().Prepare(context.Background(), claim("half", part)); err != nil {
			t.Fatal(err)
		}
		d := load(t, e.dataDir)
		c := d.Claims["uid-half"]
		c.Phase = checkpoint.PrepareStarted
		if !created { // crashed after the started mark, before the partition existed
			if _, err := e.mig.Create(e.gpus[0].UUID, true, 0, mig.Placement{Start: 6, Size: 1}); err == nil {
				t.Fatal("placement 6 should be taken")
			}
			if gone, err := e.mig.Destroy(e.gpus[0].UUID, true, 0, mig.Placement{Start: 6, Size: 1}, c.Devices[0].MIG.UUID); err != nil || !gone {
				t.Fatalf("destroy the claim's partition: %v %v", gone, err)
			}
		}
		d.Claims["uid-half"] = c
		save(t, e.dataDir, d)
		e.start()
		if n := e.node.GPUInstances(0); n != 0 {
			t.Errorf("created=%v: %d GPU instances survive the rollback", created, n)
		}
	}
}

// TestPartitionsTesseraDidNotCreateSurviveARestart: a partition an operator
// or mig-manager made, on a GPU whose layout Tessera manages (Hopper, dynamic
// MIG) or on one it does not (Ampere in MIG mode), is never destroyed at
// start, and a claim for a device overlapping it is refused, not allowed to
// destroy it.
func TestPartitionsTesseraDidNotCreateSurviveARestart(t *testing.T) {
	for _, profile := range []string{"dgx-h100", "dgx-a100"} {
		t.Run(profile, func(t *testing.T) {
			p, err := fakenode.Lookup(profile)
			if err != nil {
				t.Fatal(err)
			}
			p.MIGEnabled = []int{0, 1, 2, 3, 4, 5, 6, 7} // as an operator leaves an Ampere
			e := newEnvFrom(t, p, true)
			ctx := context.Background()
			if _, err := e.start().Prepare(ctx, claim("kept", "gpu-2-mig-1g"+map[string]string{"dgx-h100": "10gb", "dgx-a100": "5gb"}[profile]+"-6")); err != nil {
				t.Fatal(err)
			}
			// mig-manager makes a 1g at placement 0 behind Tessera's back.
			if err := e.node.CreateInstance(2, 0, 0); err != nil {
				t.Fatal(err)
			}
			e.node.ResetCalls()
			m := e.start()
			for _, c := range e.node.Calls() {
				if strings.Contains(c, "Destroy") {
					t.Errorf("restart destroyed a partition: %s", c)
				}
			}
			if n := e.node.GPUInstances(2); n != 2 {
				t.Fatalf("%d instances after restart, want the claim's and the operator's", n)
			}
			_, err = m.Prepare(ctx, claim("overlap", "gpu-2-mig-1g"+map[string]string{"dgx-h100": "10gb", "dgx-a100": "5gb"}[profile]+"-0"))
			if err == nil || !strings.Contains(err.Error(), "occupied") {
				t.Errorf("prepare over the operator's partition: %v, want occupied", err)
			}
			if n := e.node.GPUInstances(2); n != 2 {
				t.Errorf("%d instances after the refused prepare, want 2", n)
			}
		})
	}
}

// TestARestartKeepsHeldPartitions: on every faithful model (NVML's unique
// profile IDs differ from the profile indexes), a restart with partitions
// held keeps every one of them, and unprepare after the restart destroys
// exactly its own.
func TestARestartKeepsHeldPartitions(t *testing.T) {
	for _, tc := range []struct{ profile, small, large string }{
		{"dgx-h100", "gpu-1-mig-1g10gb-6", "gpu-1-mig-3g40gb-0"},
		{"dgx-h200", "gpu-1-mig-1g18gbme-6", "gpu-1-mig-3g71gb-0"},
		{"dgx-b200", "gpu-1-mig-1g45gb-4", "gpu-1-mig-2g45gb-0"},
		{"gb200-nvl72-tray", "gpu-1-mig-1g23gb-5", "gpu-1-mig-4g93gb-0"},
	} {
		t.Run(tc.profile, func(t *testing.T) {
			e := newEnv(t, tc.profile)
			ctx := context.Background()
			m := e.start()
			for _, d := range []string{tc.small, tc.large} {
				if _, err := m.Prepare(ctx, claim(strings.ReplaceAll(d, "-", ""), d)); err != nil {
					t.Fatal(err)
				}
			}
			e.node.ResetCalls()
			m = e.start()
			if c := e.node.Calls(); len(c) != 0 {
				t.Errorf("restart changed the GPU: %v", c)
			}
			if n := e.node.GPUInstances(1); n != 2 {
				t.Fatalf("%d partitions after restart, want 2", n)
			}
			if err := m.Unprepare(ctx, types.UID("uid-"+strings.ReplaceAll(tc.small, "-", ""))); err != nil {
				t.Fatal(err)
			}
			if n := e.node.GPUInstances(1); n != 1 {
				t.Errorf("%d partitions after one unprepare, want 1", n)
			}
		})
	}
}

// TestAdminAccessNeverCreatesOrDestroysAPartition: an admin-access claim on a
// partition another claim holds observes it (its MIG UUID) and, at
// unprepare, after a crash mid-prepare, or on a partition nobody holds,
// creates and destroys nothing.
func TestAdminAccessNeverCreatesOrDestroysAPartition(t *testing.T) {
	e := newEnv(t, "dgx-h100")
	ctx := context.Background()
	m := e.start()
	if _, err := m.Prepare(ctx, claim("holder", part)); err != nil {
		t.Fatal(err)
	}
	admin := func(name, dev string) *resourceapi.ResourceClaim {
		c := claim(name, dev)
		c.Status.Allocation.Devices.Results[0].AdminAccess = ptr.To(true)
		return c
	}
	e.node.ResetCalls()
	devs, err := m.Prepare(ctx, admin("monitor", part))
	if err != nil {
		t.Fatalf("admin access to a held partition: %v", err)
	}
	spec := inject(t, e.cdiDir, devs[0].CDIDeviceIDs...)
	if env := strings.Join(spec.Process.Env, " "); !strings.Contains(env, "NVIDIA_VISIBLE_DEVICES=MIG-") {
		t.Errorf("the monitor does not see the holder's MIG device: %s", env)
	}
	if _, err := m.Prepare(ctx, admin("idle", "gpu-5-mig-3g40gb-4")); err != nil {
		t.Fatalf("admin access to a partition nobody holds: %v", err)
	}
	if err := m.Unprepare(ctx, "uid-monitor"); err != nil {
		t.Fatal(err)
	}
	if err := m.Unprepare(ctx, "uid-idle"); err != nil {
		t.Fatal(err)
	}
	// A crash mid-prepare of an admin-access claim is rolled back at start.
	if _, err := m.Prepare(ctx, admin("crashed", part)); err != nil {
		t.Fatal(err)
	}
	d := load(t, e.dataDir)
	c := d.Claims["uid-crashed"]
	c.Phase = checkpoint.PrepareStarted
	d.Claims["uid-crashed"] = c
	save(t, e.dataDir, d)
	e.start()
	if c := e.node.Calls(); len(c) != 0 {
		t.Errorf("admin access changed the GPU: %v", c)
	}
	if n := e.node.GPUInstances(0); n != 1 {
		t.Errorf("%d partitions on gpu-0, want the holder's", n)
	}
	if n := e.node.GPUInstances(5); n != 0 {
		t.Errorf("admin access created %d partitions on gpu-5", n)
	}
}

func TestCorruptCheckpointKeepsClaimedPartitions(t *testing.T) {
	e := newEnv(t, "dgx-h100")
	if _, err := e.start().Prepare(context.Background(), claim("busy", part)); err != nil {
		t.Fatal(err)
	}
	save(t, e.dataDir, checkpoint.Data{}) // placeholder, then corrupt it
	writeJunk(t, e.dataDir)
	m := e.start()
	if n := e.node.GPUInstances(0); n != 1 {
		t.Fatalf("a partition in use was destroyed after the checkpoint was lost (%d left)", n)
	}
	if err := m.Unprepare(context.Background(), "uid-busy"); err != nil {
		t.Fatal(err)
	}
	if n := e.node.GPUInstances(0); n != 0 {
		t.Errorf("%d instances after unprepare of the rebuilt claim", n)
	}
}

func TestStaticMIGDevicesAreInjectedNotCreated(t *testing.T) {
	p, err := fakenode.Lookup("dgx-a100")
	if err != nil {
		t.Fatal(err)
	}
	p.MIGInstances = map[int][]fakenode.StaticInstance{3: {{Index: 0, Start: 2}}}
	e := newEnvFrom(t, p, false)
	m := e.start()
	e.node.ResetCalls()
	devs, err := m.Prepare(context.Background(), claim("static", "gpu-3-mig-1g5gb-2"))
	if err != nil {
		t.Fatal(err)
	}
	if c := e.node.Calls(); len(c) != 0 {
		t.Errorf("static MIG changed the GPU: %v", c)
	}
	spec := inject(t, e.cdiDir, devs[0].CDIDeviceIDs...)
	if len(spec.Linux.Devices) < 3 {
		t.Errorf("devices %v", spec.Linux.Devices)
	}
	if err := m.Unprepare(context.Background(), "uid-static"); err != nil {
		t.Fatal(err)
	}
	if n := e.node.GPUInstances(3); n != 1 {
		t.Errorf("unprepare destroyed the operator's instance (%d left)", n)
	}
}

func TestPrepareRefusesHardwareAnotherClaimUses(t *testing.T) {
	m := newEnv(t, "dgx-h100").start()
	ctx := context.Background()
	if _, err := m.Prepare(ctx, claim("part", "gpu-4-mig-3g40gb-4")); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ name, dev string }{
		{"whole", "gpu-4"},                 // the GPU is partitioned
		{"overlap", "gpu-4-mig-1g10gb-5"},  // inside the 3g placement
		{"overlap2", "gpu-4-mig-2g20gb-4"}, // shares slices 4 and 5
	} {
		_, err := m.Prepare(ctx, claim(tc.name, tc.dev))
		if err == nil || !strings.Contains(err.Error(), "shares GPU gpu-4 with device gpu-4-mig-3g40gb-4") {
			t.Errorf("%s: got %v", tc.dev, err)
		}
	}
	if _, err := m.Prepare(ctx, claim("beside", "gpu-4-mig-1g10gb-0")); err != nil {
		t.Errorf("a disjoint partition was refused: %v", err)
	}
	if _, err := m.Prepare(ctx, claim("whole5", "gpu-5")); err != nil {
		t.Fatal(err)
	}
	if _, err := m.Prepare(ctx, claim("under-whole", "gpu-5-mig-1g10gb-6")); err == nil {
		t.Error("a partition of a GPU held whole was prepared")
	}
}

func TestAFailedPrepareDestroysThePartitionItCreated(t *testing.T) {
	e := newEnv(t, "dgx-h100")
	// A host whose kernel lists no MIG capability minors: the partition is
	// created, then cannot be injected.
	minors := filepath.Join(e.node.HostRoot, "proc", "driver", "nvidia-caps", "mig-minors")
	if err := os.WriteFile(minors, []byte("config 1\nmonitor 2\n"), 0o444); err != nil {
		t.Fatal(err)
	}
	m := e.start()
	_, err := m.Prepare(context.Background(), claim("doomed", part))
	if err == nil || !strings.Contains(err.Error(), "no MIG capability minor") {
		t.Fatalf("got %v", err)
	}
	if n := e.node.GPUInstances(0); n != 0 {
		t.Errorf("%d GPU instances left by the failed prepare", n)
	}
	if len(m.PreparedClaims()) != 0 {
		t.Errorf("claims after failure: %v", m.PreparedClaims())
	}
}

// TestACrashAfterAnOccupiedPrepareLeavesTheOccupantAlone: a claim is
// allocated a partition whose placement an operator's instance occupies; its
// prepare fails "occupied", and the plugin dies before the rollback reaches
// the checkpoint, which still says PrepareStarted with the partition's
// record. Neither the restart's rollback nor the kubelet's retry may destroy
// or adopt the operator's instance: the record never named its UUID.
func TestACrashAfterAnOccupiedPrepareLeavesTheOccupantAlone(t *testing.T) {
	e := newEnv(t, "dgx-h100")
	ctx := context.Background()
	m := e.start()
	if err := e.node.CreateInstance(0, 0, 6); err != nil { // 1g.10gb at 6, behind Tessera's back
		t.Fatal(err)
	}
	foreign, err := e.mig.Instances(e.gpus[0].UUID)
	if err != nil || len(foreign) != 1 {
		t.Fatalf("operator's instance: %v %v", foreign, err)
	}
	if _, err := m.Prepare(ctx, claim("x", part)); err == nil || !strings.Contains(err.Error(), "occupied") {
		t.Fatalf("prepare over the operator's instance: %v, want occupied", err)
	}
	// The crash: the started record (no UUID: nothing was made) is what the
	// disk still holds.
	d := load(t, e.dataDir)
	d.Claims["uid-x"] = checkpoint.Claim{Namespace: "default", Name: "x", Phase: checkpoint.PrepareStarted, Devices: []checkpoint.Device{{
		Requests: []string{"req-0"}, Pool: nodeName, Device: part,
		MIG: &checkpoint.MIGPartition{GPUUUID: e.gpus[0].UUID, ProfileIndex: 0, Start: 6, Size: 1, Switchable: true},
	}}}
	save(t, e.dataDir, d)
	e.node.ResetCalls()
	m = e.start()
	if _, err := m.Prepare(ctx, claim("x", part)); err == nil || !strings.Contains(err.Error(), "occupied") {
		t.Errorf("the kubelet's retry: %v, want occupied (the operator's instance is not the claim's)", err)
	}
	for _, c := range e.node.Calls() {
		if strings.Contains(c, "Destroy") {
			t.Errorf("the operator's instance was touched: %s", c)
		}
	}
	after, err := e.mig.Instances(e.gpus[0].UUID)
	if err != nil || len(after) != 1 || after[0].UUID != foreign[0].UUID {
		t.Errorf("after restart and retry: %+v (%v), want the operator's %s only", after, err, foreign[0].UUID)
	}
}
