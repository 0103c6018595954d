package prepare_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/opencontainers/runtime-spec/specs-go"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"

	"github.com/tessera-dev/tessera/cdi"
	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/devnodes"
	"github.com/tessera-dev/tessera/driver/discovery"
	"github.com/tessera-dev/tessera/driver/domain"
	"github.com/tessera-dev/tessera/driver/driverfiles"
	"github.com/tessera-dev/tessera/driver/fakenode"
	"github.com/tessera-dev/tessera/driver/gpuset"
	"github.com/tessera-dev/tessera/driver/hostnodes"
	"github.com/tessera-dev/tessera/driver/inventory"
	"github.com/tessera-dev/tessera/driver/mig"
	"github.com/tessera-dev/tessera/driver/nodelock"
	"github.com/tessera-dev/tessera/driver/prepare"
	"github.com/tessera-dev/tessera/test/fixtures"
)

const (
	driverName = "gpu.tessera.dev"
	nodeName   = "node-a"
)

// env is one simulated node's prepare environment; restart builds a new
// Manager over the same disk state, as a restarted plugin would.
type env struct {
	t       *testing.T
	node    *fakenode.Node
	gpus    []discovery.GPU
	cdiDir  string
	dataDir string
	bootID  string
	// dynamicMIG lays the node out with MIG partitions (the default gate).
	dynamicMIG bool
	mig        *mig.Manager
	// share lays GPUs out for independent claims to share; mps runs MPS
	// daemons (nil: none).
	share func(discovery.GPU) inventory.Share
	mps   prepare.MPSDaemons
	// imex runs IMEX daemons (Config.IMEX); nil runs none.
	imex prepare.IMEXDaemons
	// rolling makes each Manager one of two instances of a rolling update
	// (Config.Shared).
	rolling bool
}

func newEnv(t *testing.T, profile string) *env {
	t.Helper()
	return newEnvFrom(t, fixtures.Profile(t, profile), true)
}

func newEnvFrom(t *testing.T, p fakenode.Profile, dynamicMIG bool) *env {
	t.Helper()
	n, gpus := fixtures.Node(t, p, nodeName)
	return &env{t: t, node: n, gpus: gpus, cdiDir: t.TempDir(), dataDir: t.TempDir(), bootID: "boot-1", dynamicMIG: dynamicMIG, mig: mig.NewManager(n.NVML)}
}

// testHook is where the tests' specs say tessera-cdi-hook is.
const testHook = "/opt/tessera/tessera-cdi-hook"

func (e *env) config() prepare.Config {
	e.t.Helper()
	store, err := cdi.NewStore(e.cdiDir)
	if err != nil {
		e.t.Fatal(err)
	}
	ck, err := checkpoint.NewStore(e.dataDir)
	if err != nil {
		e.t.Fatal(err)
	}
	dev, err := devnodes.New(e.node.DevRoot(), e.node.HostRoot)
	if err != nil {
		e.t.Fatal(err)
	}
	files, err := driverfiles.Find(context.Background(), driverfiles.Options{Root: e.node.DriverRoot, Hook: testHook})
	if err != nil {
		e.t.Fatal(err)
	}
	domains, err := cdi.NewStoreOfClass(e.cdiDir, domain.CDIClass)
	if err != nil {
		e.t.Fatal(err)
	}
	inv := inventory.Build(e.gpus, inventory.Options{DynamicMIG: e.dynamicMIG, Sharing: e.share})
	cfg := prepare.Config{DriverName: driverName, PoolName: nodeName, Inventory: inv, MIG: e.mig, CDI: store, DomainCDI: domains, Checkpoint: ck, DevNodes: dev, DriverEdits: files.Edits, BootID: e.bootID,
		HostNodes: &hostnodes.Nodes{Dir: filepath.Join(e.dataDir, "device-nodes"), Maker: e.node.Nodes, DevRoot: dev.DevRoot},
		Settings:  gpuset.New(e.node.NVML), MPS: e.mps, IMEX: e.imex}
	if e.rolling {
		cfg.Shared = nodelock.New(e.dataDir)
	}
	return cfg
}

func (e *env) start() *prepare.Manager {
	e.t.Helper()
	m, err := prepare.New(context.Background(), e.config())
	if err != nil {
		e.t.Fatal(err)
	}
	return m
}

func claim(name string, devices ...string) *resourceapi.ResourceClaim {
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name, UID: types.UID("uid-" + name)}}
	c.Status.Allocation = &resourceapi.AllocationResult{}
	for i, d := range devices {
		c.Status.Allocation.Devices.Results = append(c.Status.Allocation.Devices.Results, resourceapi.DeviceRequestAllocationResult{
			Request: fmt.Sprintf("req-%d", i), Driver: driverName, Pool: nodeName, Device: d,
		})
	}
	return c
}

func specFiles(t *testing.T, dir string) []string {
	t.Helper()
	m, _ := filepath.Glob(filepath.Join(dir, "*.json"))
	return m
}

// inject applies CDI device IDs to an empty OCI spec the way containerd does.
func inject(t *testing.T, dir string, ids ...string) *specs.Spec {
	t.Helper()
	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(dir), cdiapi.WithAutoRefresh(false))
	if err != nil {
		t.Fatal(err)
	}
	spec := &specs.Spec{Process: &specs.Process{}, Linux: &specs.Linux{}}
	if _, err := cache.InjectDevices(spec, ids...); err != nil {
		t.Fatalf("inject %v: %v", ids, err)
	}
	return spec
}

func TestPrepareInjectsTheGPUAndIsIdempotent(t *testing.T) {
	e := newEnv(t, "dgx-h100")
	m := e.start()
	c := claim("train", "gpu-2", "gpu-5")
	devs, err := m.Prepare(context.Background(), c)
	if err != nil {
		t.Fatal(err)
	}
	if len(devs) != 2 || devs[0].DeviceName != "gpu-2" || devs[1].DeviceName != "gpu-5" || devs[0].PoolName != nodeName {
		t.Fatalf("devices %+v", devs)
	}
	var ids []string
	for _, d := range devs {
		if len(d.CDIDeviceIDs) != 1 || !strings.HasPrefix(d.CDIDeviceIDs[0], "gpu.tessera.dev/gpu=uid-train-") {
			t.Fatalf("CDI IDs %v", d.CDIDeviceIDs)
		}
		ids = append(ids, d.CDIDeviceIDs...)
	}
	spec := inject(t, e.cdiDir, ids...)
	var nodes []string
	for _, d := range spec.Linux.Devices {
		nodes = append(nodes, fmt.Sprintf("%s %d:%d", d.Path, d.Major, d.Minor))
	}
	want := []string{"/dev/nvidia-uvm 235:0", "/dev/nvidia-uvm-tools 235:1", "/dev/nvidia2 195:2", "/dev/nvidia5 195:5", "/dev/nvidiactl 195:255"}
	slices.Sort(nodes)
	if diff := cmp.Diff(want, nodes); diff != "" {
		t.Errorf("device nodes (-want +got):\n%s", diff)
	}
	envs := strings.Join(spec.Process.Env, " ")
	if !strings.Contains(envs, "NVIDIA_VISIBLE_DEVICES="+e.gpus[2].UUID+","+e.gpus[5].UUID) {
		t.Errorf("env %s lacks the visible GPUs", envs)
	}
	var mounts []string
	for _, mt := range spec.Mounts {
		mounts = append(mounts, mt.Destination)
	}
	if !slices.Contains(mounts, "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1") || !slices.Contains(mounts, "/usr/bin/nvidia-smi") {
		t.Errorf("driver files not mounted: %v", mounts)
	}

	before, _ := os.Stat(specFiles(t, e.cdiDir)[0])
	again, err := m.Prepare(context.Background(), c)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(devs, again); diff != "" {
		t.Errorf("repeated prepare differs:\n%s", diff)
	}
	after, _ := os.Stat(specFiles(t, e.cdiDir)[0])
	if !after.ModTime().Equal(before.ModTime()) {
		t.Error("repeated prepare rewrote the CDI spec")
	}
}

func TestPrepareRefusesADeviceHeldByAnotherClaim(t *testing.T) {
	e := newEnv(t, "pcie-l4x4")
	m := e.start()
	if _, err := m.Prepare(context.Background(), claim("first", "gpu-1")); err != nil {
		t.Fatal(err)
	}
	_, err := m.Prepare(context.Background(), claim("second", "gpu-0", "gpu-1"))
	if err == nil || !strings.Contains(err.Error(), "gpu-1 is already prepared for claim default/first") || !strings.Contains(err.Error(), "unprepare it first") {
		t.Fatalf("got %v", err)
	}
	// The refused claim holds nothing: gpu-0 is still free.
	if _, err := m.Prepare(context.Background(), claim("third", "gpu-0")); err != nil {
		t.Fatalf("gpu-0 leaked to the refused claim: %v", err)
	}
	if n := len(specFiles(t, e.cdiDir)); n != 2 {
		t.Errorf("%d CDI specs, want 2", n)
	}
}

func TestPrepareRefusesUnknownDevicesAndUnallocatedClaims(t *testing.T) {
	m := newEnv(t, "pcie-l4x4").start()
	if _, err := m.Prepare(context.Background(), claim("ghost", "gpu-9")); err == nil || !strings.Contains(err.Error(), "gpu-9 does not exist") {
		t.Errorf("got %v", err)
	}
	c := claim("pending")
	c.Status.Allocation = nil
	if _, err := m.Prepare(context.Background(), c); err == nil {
		t.Error("an unallocated claim was prepared")
	}
}

func TestPrepareIgnoresOtherDriversAndNodes(t *testing.T) {
	m := newEnv(t, "pcie-l4x4").start()
	c := claim("mixed", "gpu-0")
	c.Status.Allocation.Devices.Results = append(c.Status.Allocation.Devices.Results,
		resourceapi.DeviceRequestAllocationResult{Request: "nic", Driver: "nic.example.com", Pool: nodeName, Device: "eth0"},
		resourceapi.DeviceRequestAllocationResult{Request: "far", Driver: driverName, Pool: "node-b", Device: "gpu-1"})
	devs, err := m.Prepare(context.Background(), c)
	if err != nil || len(devs) != 1 || devs[0].DeviceName != "gpu-0" {
		t.Fatalf("got %+v, %v", devs, err)
	}
}

func TestUnprepareFreesTheDeviceAndRemovesTheSpec(t *testing.T) {
	e := newEnv(t, "pcie-l4x4")
	m := e.start()
	ctx := context.Background()
	if err := m.Unprepare(ctx, "never-prepared"); err != nil {
		t.Fatalf("unprepare of an unknown claim: %v", err)
	}
	if _, err := m.Prepare(ctx, claim("a", "gpu-3")); err != nil {
		t.Fatal(err)
	}
	if err := m.Unprepare(ctx, "uid-a"); err != nil {
		t.Fatal(err)
	}
	if err := m.Unprepare(ctx, "uid-a"); err != nil {
		t.Fatalf("second unprepare: %v", err)
	}
	if f := specFiles(t, e.cdiDir); len(f) != 0 {
		t.Errorf("specs left: %v", f)
	}
	if _, err := m.Prepare(ctx, claim("b", "gpu-3")); err != nil {
		t.Fatalf("gpu-3 not free after unprepare: %v", err)
	}
}

func TestAdminAccessObservesWithoutTakingTheDevice(t *testing.T) {
	m := newEnv(t, "pcie-l4x4").start()
	ctx := context.Background()
	mon := claim("monitor", "gpu-0")
	mon.Status.Allocation.Devices.Results[0].AdminAccess = ptr.To(true)
	if _, err := m.Prepare(ctx, mon); err != nil {
		t.Fatal(err)
	}
	if _, err := m.Prepare(ctx, claim("work", "gpu-0")); err != nil {
		t.Fatalf("admin access took the device: %v", err)
	}
}

func TestIndependentClaimsPrepareConcurrently(t *testing.T) {
	e := newEnv(t, "dgx-h100")
	m := e.start()
	ctx := context.Background()
	var wg sync.WaitGroup
	errs := make([]error, 8)
	for i := range 8 {
		wg.Go(func() {
			c := claim(fmt.Sprintf("c%d", i), fmt.Sprintf("gpu-%d", i))
			for range 5 {
				if _, errs[i] = m.Prepare(ctx, c); errs[i] != nil {
					return
				}
				if errs[i] = m.Unprepare(ctx, c.UID); errs[i] != nil {
					return
				}
			}
			_, errs[i] = m.Prepare(ctx, c)
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("claim %d: %v", i, err)
		}
	}
	if n := len(m.PreparedClaims()); n != 8 {
		t.Errorf("%d claims prepared, want 8", n)
	}
}

func TestRacingClaimsForOneGPUHaveOneWinner(t *testing.T) {
	m := newEnv(t, "dgx-h100").start()
	var wg sync.WaitGroup
	var mu sync.Mutex
	wins := 0
	for i := range 16 {
		wg.Go(func() {
			if _, err := m.Prepare(context.Background(), claim(fmt.Sprintf("r%d", i), "gpu-7")); err == nil {
				mu.Lock()
				wins++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if wins != 1 {
		t.Fatalf("%d claims prepared gpu-7, want exactly 1", wins)
	}
}

// TestAnUnprepareWritesTheCheckpointOnlyAsOftenAsItMustUndo: the unprepare
// of a claim whose prepare only wrote a CDI spec (a whole GPU, no setting or
// daemon) writes the checkpoint once, its record's removal, as its prepare
// does; one with a MIG partition to destroy first marks its start, so that a
// crash mid-way is finished from the record (twice).
func TestAnUnprepareWritesTheCheckpointOnlyAsOftenAsItMustUndo(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t, "dgx-h100")
	cfg := e.config()
	var writes atomic.Int32
	cfg.Checkpoint.OnWrite = func(time.Duration) { writes.Add(1) }
	m, err := prepare.New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		device string
		want   int32
	}{{"gpu-1", 1}, {part, 2}} {
		c := claim("c-"+tc.device, tc.device)
		if _, err := m.Prepare(ctx, c); err != nil {
			t.Fatal(err)
		}
		writes.Store(0)
		if err := m.Unprepare(ctx, c.UID); err != nil {
			t.Fatal(err)
		}
		if n := writes.Load(); n != tc.want {
			t.Errorf("unprepare of %s wrote the checkpoint %d times, want %d", tc.device, n, tc.want)
		}
		if f := specFiles(t, e.cdiDir); len(f) != 0 {
			t.Errorf("specs left after unprepare of %s: %v", tc.device, f)
		}
		if got := e.start().PreparedClaims(); len(got) != 0 {
			t.Errorf("a restart after unprepare of %s finds %v", tc.device, got)
		}
	}
}
