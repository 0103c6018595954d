package prepare_test

import (
	"context"
	"fmt"
	"maps"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/google/go-cmp/cmp"
	"github.com/opencontainers/runtime-spec/specs-go"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/utils/ptr"

	"github.com/tessera-dev/tessera/cdi"
	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/discovery"
	"github.com/tessera-dev/tessera/driver/inventory"
	"github.com/tessera-dev/tessera/driver/prepare"
)

// shared makes a claim's first result one share of its device, as the
// scheduler allocates a device with allowMultipleAllocations.
func shared(c *resourceapi.ResourceClaim, memory string) *resourceapi.ResourceClaim {
	r := &c.Status.Allocation.Devices.Results[0]
	r.ShareID = ptr.To(types.UID("share-" + c.Name))
	if memory != "" {
		r.ConsumedCapacity = map[resourceapi.QualifiedName]resource.Quantity{"memory": resource.MustParse(memory)}
	}
	return c
}

func timeSliced(n int) func(discovery.GPU) inventory.Share {
	return func(discovery.GPU) inventory.Share { return inventory.Share{TimeSlices: n} }
}

func memoryShared(discovery.GPU) inventory.Share { return inventory.Share{Memory: true} }

func gpuConfig(c *resourceapi.ResourceClaim, body string) *resourceapi.ResourceClaim {
	return withConfig(c, driverName, `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig",`+body+`}`)
}

func containerEnv(t *testing.T, dir string, devs []kubeletplugin.Device) map[string]string {
	t.Helper()
	var ids []string
	for _, d := range devs {
		ids = append(ids, d.CDIDeviceIDs...)
	}
	env := map[string]string{}
	for _, kv := range inject(t, dir, ids...).Process.Env {
		k, v, _ := strings.Cut(kv, "=")
		env[k] = v
	}
	return env
}

func TestTimeSlicedGPUServesIndependentClaimsAndRestoresItsComputeMode(t *testing.T) {
	e := newEnv(t, "dgx-h100")
	e.share = timeSliced(3)
	// The operator left GPU 0 in ExclusiveProcess: time slices need Default.
	if ret := e.node.Server.Devices[0].SetComputeMode(nvml.COMPUTEMODE_EXCLUSIVE_PROCESS); ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	e.node.ResetCalls()
	m := e.start()
	ctx := context.Background()
	var claims []*resourceapi.ResourceClaim
	for _, name := range []string{"a", "b", "c"} {
		c := shared(claim(name, "gpu-0"), "")
		devs, err := m.Prepare(ctx, c)
		if err != nil {
			t.Fatalf("slice %s: %v", name, err)
		}
		if env := containerEnv(t, e.cdiDir, devs); env["NVIDIA_VISIBLE_DEVICES"] != e.gpus[0].UUID {
			t.Errorf("slice %s: NVIDIA_VISIBLE_DEVICES=%q, want GPU 0's UUID", name, env["NVIDIA_VISIBLE_DEVICES"])
		}
		claims = append(claims, c)
	}
	if got := e.node.ComputeMode(0); got != nvml.COMPUTEMODE_DEFAULT {
		t.Errorf("compute mode while shared = %d, want Default", got)
	}
	// An exclusive claim of the shared GPU is refused: the last line of
	// defence if the scheduler mixed the two.
	if _, err := m.Prepare(ctx, claim("whole", "gpu-0")); err == nil || !strings.Contains(err.Error(), "without a share ID") {
		t.Errorf("exclusive claim of a shared GPU: %v", err)
	}
	for i, c := range claims {
		if err := m.Unprepare(ctx, c.UID); err != nil {
			t.Fatal(err)
		}
		if want := nvml.COMPUTEMODE_DEFAULT; i < 2 && e.node.ComputeMode(0) != want {
			t.Errorf("after %d of 3 slices unprepared: compute mode %d, want Default while others run", i+1, e.node.ComputeMode(0))
		}
	}
	want := []string{"gpu-0 SetComputeMode(0)", "gpu-0 SetComputeMode(3)"}
	if diff := cmp.Diff(want, e.node.Calls()); diff != "" {
		t.Errorf("NVML calls (-want +got):\n%s", diff)
	}
	if got := e.node.ComputeMode(0); got != nvml.COMPUTEMODE_EXCLUSIVE_PROCESS {
		t.Errorf("compute mode after the last slice = %d, want the operator's ExclusiveProcess back", got)
	}
}

func TestTimeSlicingConfigSharesOneClaimsGPU(t *testing.T) {
	e := newEnv(t, "pcie-l4x4")
	if ret := e.node.Server.Devices[2].SetComputeMode(nvml.COMPUTEMODE_PROHIBITED); ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	e.node.ResetCalls()
	m := e.start()
	ctx := context.Background()
	c := gpuConfig(claim("notebook", "gpu-2"), `"sharing":{"strategy":"TimeSlicing","timeSlicingConfig":{"interval":"Default"}}`)
	if _, err := m.Prepare(ctx, c); err != nil {
		t.Fatal(err)
	}
	if got := e.node.ComputeMode(2); got != nvml.COMPUTEMODE_DEFAULT {
		t.Errorf("compute mode = %d, want Default so every pod sharing the claim runs", got)
	}
	if err := m.Unprepare(ctx, c.UID); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]string{"gpu-2 SetComputeMode(0)", "gpu-2 SetComputeMode(2)"}, e.node.Calls()); diff != "" {
		t.Errorf("NVML calls (-want +got):\n%s", diff)
	}
}

func TestPowerLimitIsAppliedAndRestored(t *testing.T) {
	e := newEnv(t, "dgx-h100")
	m := e.start()
	ctx := context.Background()
	c := gpuConfig(claim("capped", "gpu-1"), `"powerLimitWatts":350`)
	if _, err := m.Prepare(ctx, c); err != nil {
		t.Fatal(err)
	}
	if got := e.node.PowerLimitMW(1); got != 350000 {
		t.Errorf("power limit while prepared = %d mW, want 350000", got)
	}
	// Idempotent: a retried prepare changes nothing.
	if _, err := m.Prepare(ctx, c); err != nil {
		t.Fatal(err)
	}
	if err := m.Unprepare(ctx, c.UID); err != nil {
		t.Fatal(err)
	}
	want := []string{"gpu-1 SetPowerManagementLimit(350000)", "gpu-1 SetPowerManagementLimit(700000)"}
	if diff := cmp.Diff(want, e.node.Calls()); diff != "" {
		t.Errorf("NVML calls (-want +got):\n%s", diff)
	}
	ck, err := checkpoint.NewStore(e.dataDir)
	if err != nil {
		t.Fatal(err)
	}
	if data, err := ck.Load(); err != nil || len(data.GPUs) != 0 {
		t.Errorf("checkpoint keeps GPU originals after everything was restored: %+v %v", data.GPUs, err)
	}
}

func TestPowerLimitIsRestoredAfterACrash(t *testing.T) {
	t.Run("crash while prepared, unprepared by the next process", func(t *testing.T) {
		e := newEnv(t, "dgx-h100")
		c := gpuConfig(claim("capped", "gpu-4"), `"powerLimitWatts":400`)
		if _, err := e.start().Prepare(context.Background(), c); err != nil {
			t.Fatal(err)
		}
		// The process dies; a new one unprepares the claim.
		if err := e.start().Unprepare(context.Background(), c.UID); err != nil {
			t.Fatal(err)
		}
		if got := e.node.PowerLimitMW(4); got != 700000 {
			t.Errorf("power limit = %d mW, want the original 700000 back", got)
		}
	})
	t.Run("crash mid-prepare, rolled back at start", func(t *testing.T) {
		e := newEnv(t, "dgx-h100")
		c := gpuConfig(claim("capped", "gpu-4"), `"powerLimitWatts":400`)
		if _, err := e.start().Prepare(context.Background(), c); err != nil {
			t.Fatal(err)
		}
		// As if the process died after capping the GPU and before
		// writing the CDI spec.
		e.rewindToStarted(c)
		m := e.start()
		if len(m.PreparedClaims()) != 0 {
			t.Errorf("interrupted claim not rolled back: %v", m.PreparedClaims())
		}
		if got := e.node.PowerLimitMW(4); got != 700000 {
			t.Errorf("power limit = %d mW, want the original 700000 back", got)
		}
	})
}

func TestSharedGPUPowerLimitsMustAgree(t *testing.T) {
	e := newEnv(t, "dgx-h100")
	e.share = timeSliced(4)
	m := e.start()
	ctx := context.Background()
	a := gpuConfig(shared(claim("a", "gpu-0"), ""), `"powerLimitWatts":500`)
	b := gpuConfig(shared(claim("b", "gpu-0"), ""), `"powerLimitWatts":500`)
	odd := gpuConfig(shared(claim("odd", "gpu-0"), ""), `"powerLimitWatts":300`)
	for _, c := range []*resourceapi.ResourceClaim{a, b} {
		if _, err := m.Prepare(ctx, c); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := m.Prepare(ctx, odd); err == nil || !strings.Contains(err.Error(), "powerLimitWatts 300 disagrees with 500 W") {
		t.Errorf("disagreeing limit: %v", err)
	}
	if err := m.Unprepare(ctx, a.UID); err != nil {
		t.Fatal(err)
	}
	if got := e.node.PowerLimitMW(0); got != 500000 {
		t.Errorf("limit with one user left = %d mW, want 500000", got)
	}
	if err := m.Unprepare(ctx, b.UID); err != nil {
		t.Fatal(err)
	}
	if got := e.node.PowerLimitMW(0); got != 700000 {
		t.Errorf("limit after the last user = %d mW, want 700000", got)
	}
}

func TestMemorySharesInjectLimitsAndNeverOvercommit(t *testing.T) {
	e := newEnv(t, "dgx-h100") // 80 GiB H100s in the mock
	e.share = memoryShared
	m := e.start()
	ctx := context.Background()
	gpuMiB := e.gpus[0].MemoryBytes >> 20
	half := resource.NewQuantity(e.gpus[0].MemoryBytes/2/(1<<30)*(1<<30), resource.BinarySI).String()
	for _, name := range []string{"a", "b"} {
		c := shared(claim(name, "gpu-0"), half)
		devs, err := m.Prepare(ctx, c)
		if err != nil {
			t.Fatalf("share %s: %v", name, err)
		}
		q := resource.MustParse(half)
		if got, want := containerEnv(t, e.cdiDir, devs)["TESSERA_GPU_0_MEMORY_LIMIT_MIB"], q.Value()>>20; got != fmt.Sprint(want) {
			t.Errorf("share %s: TESSERA_GPU_0_MEMORY_LIMIT_MIB=%q, want %d", name, got, want)
		}
	}
	if _, err := m.Prepare(ctx, shared(claim("third", "gpu-0"), "10Gi")); err == nil || !strings.Contains(err.Error(), "more than the GPU's") {
		t.Errorf("overcommitting share of a %d MiB GPU: %v", gpuMiB, err)
	}
}

// fakeMPS records what the state machine asks of MPS daemons.
type fakeMPS struct {
	mu      sync.Mutex
	started []prepare.MPSDaemon
	stopped []string
	running map[string]bool // by pod
	dir     string
	// off is a plugin without an MPS image: it stops daemons, starts none.
	off bool
}

func (f *fakeMPS) Runs() bool { return !f.off }

// Running lists the pods of the daemons started and not stopped since.
func (f *fakeMPS) Running() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Sorted(maps.Keys(f.running))
}

func (f *fakeMPS) Locate(uid string) checkpoint.MPSDaemon {
	return checkpoint.MPSDaemon{Pod: "tessera-mps-" + uid, Dir: f.dir + "/" + uid}
}

func (f *fakeMPS) Start(_ context.Context, d prepare.MPSDaemon) (cdi.Edits, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.started = append(f.started, d)
	if f.running == nil {
		f.running = map[string]bool{}
	}
	f.running[d.Pod] = true
	if err := os.MkdirAll(d.Dir+"/pipe", 0o755); err != nil {
		return cdi.Edits{}, err
	}
	return cdi.Edits{
		Env:    []string{"CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"},
		Mounts: []cdi.Mount{{HostPath: d.Dir + "/pipe", ContainerPath: "/tmp/nvidia-mps"}},
	}, nil
}

func (f *fakeMPS) Stop(_ context.Context, d checkpoint.MPSDaemon) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.stopped = append(f.stopped, d.Pod)
	delete(f.running, d.Pod)
	return os.RemoveAll(d.Dir)
}

func TestMPSClaimRunsOneDaemonWithItsLimits(t *testing.T) {
	e := newEnv(t, "dgx-h100")
	mps := &fakeMPS{dir: t.TempDir()}
	e.mps = mps
	m := e.start()
	ctx := context.Background()
	c := gpuConfig(claim("inference", "gpu-3", "gpu-6"), `"sharing":{"strategy":"MPS","mpsConfig":{"defaultActiveThreadPercentage":25,"defaultPinnedDeviceMemoryLimit":"10Gi","defaultPerDevicePinnedMemoryLimit":{"1":"2Gi"}}}`)
	devs, err := m.Prepare(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	if len(mps.started) != 1 {
		t.Fatalf("daemons started: %d, want one for the claim", len(mps.started))
	}
	d := mps.started[0]
	if want := []string{e.gpus[3].UUID, e.gpus[6].UUID}; !slices.Equal(d.Devices, want) {
		t.Errorf("daemon serves %v, want %v", d.Devices, want)
	}
	wantEnv := []string{"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M,1=2048M"}
	if diff := cmp.Diff(wantEnv, d.Env); diff != "" {
		t.Errorf("daemon env (-want +got):\n%s", diff)
	}
	spec := inject(t, e.cdiDir, append(devs[0].CDIDeviceIDs, devs[1].CDIDeviceIDs...)...)
	if !slices.Contains(spec.Process.Env, "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps") {
		t.Errorf("container env %v lacks the daemon's pipe directory", spec.Process.Env)
	}
	if !slices.ContainsFunc(spec.Mounts, func(mt specs.Mount) bool { return mt.Destination == "/tmp/nvidia-mps" }) {
		t.Errorf("container mounts %v lack the daemon's pipe directory", spec.Mounts)
	}
	for _, g := range []int{3, 6} {
		if got := e.node.ComputeMode(g); got != nvml.COMPUTEMODE_EXCLUSIVE_PROCESS {
			t.Errorf("GPU %d compute mode = %d, want ExclusiveProcess for the MPS server", g, got)
		}
	}
	if err := m.Unprepare(ctx, c.UID); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(mps.stopped, []string{"tessera-mps-uid-inference"}) {
		t.Errorf("daemons stopped: %v", mps.stopped)
	}
	for _, g := range []int{3, 6} {
		if got := e.node.ComputeMode(g); got != nvml.COMPUTEMODE_DEFAULT {
			t.Errorf("GPU %d compute mode after unprepare = %d, want Default back", g, got)
		}
	}
}

// TestTurningMPSOffKeepsWhatIsPrepared: once the plugin runs without MPS
// daemons, a claim prepared with one before is still found prepared when
// the kubelet asks again, a new MPS claim is refused naming --mps-image,
// and the unprepare stops the daemon that ran.
// mpsPrepared prepares an MPS claim (name, on gpu) on a DGX H100 whose
// plugin runs MPS daemons.
func mpsPrepared(t *testing.T, name, gpu string) (*env, *fakeMPS, *resourceapi.ResourceClaim) {
	t.Helper()
	e := newEnv(t, "dgx-h100")
	mps := &fakeMPS{dir: t.TempDir()}
	e.mps = mps
	c := gpuConfig(claim(name, gpu), `"sharing":{"strategy":"MPS"}`)
	if _, err := e.start().Prepare(context.Background(), c); err != nil {
		t.Fatal(err)
	}
	return e, mps, c
}

func TestTurningMPSOffKeepsWhatIsPrepared(t *testing.T) {
	e, mps, c := mpsPrepared(t, "inference", "gpu-3")
	ctx := context.Background()
	mps.off = true
	m := e.start()
	if _, err := m.Prepare(ctx, c); err != nil {
		t.Errorf("prepare again, with MPS off, of the claim prepared with it: %v", err)
	}
	if _, err := m.Prepare(ctx, gpuConfig(claim("new", "gpu-4"), `"sharing":{"strategy":"MPS"}`)); err == nil || !strings.Contains(err.Error(), "--mps-image") {
		t.Errorf("prepare of a new MPS claim with MPS off: %v, want a refusal naming --mps-image", err)
	}
	if err := m.Unprepare(ctx, c.UID); err != nil {
		t.Fatal(err)
	}
	if len(mps.started) != 1 || !slices.Equal(mps.stopped, []string{"tessera-mps-uid-inference"}) {
		t.Errorf("daemons started %d, stopped %v: want the one from before MPS was turned off stopped", len(mps.started), mps.stopped)
	}
}

func TestMPSDaemonOfAnInterruptedPrepareIsStoppedAtStart(t *testing.T) {
	e := newEnv(t, "dgx-h100")
	mps := &fakeMPS{dir: t.TempDir()}
	e.mps = mps
	c := gpuConfig(claim("inference", "gpu-3"), `"sharing":{"strategy":"MPS"}`)
	if _, err := e.start().Prepare(context.Background(), c); err != nil {
		t.Fatal(err)
	}
	if rec := e.rewindToStarted(c); rec.MPS == nil {
		t.Fatal("the checkpoint does not record the claim's MPS daemon")
	}
	e.start()
	if !slices.Equal(mps.stopped, []string{"tessera-mps-uid-inference"}) {
		t.Errorf("daemons stopped at start: %v, want the interrupted claim's", mps.stopped)
	}
	if got := e.node.ComputeMode(3); got != nvml.COMPUTEMODE_DEFAULT {
		t.Errorf("compute mode = %d, want Default restored", got)
	}
}

func TestMPSIsRefusedOnAGPUIndependentClaimsShare(t *testing.T) {
	e := newEnv(t, "dgx-h100")
	e.share = timeSliced(2)
	e.mps = &fakeMPS{dir: t.TempDir()}
	m := e.start()
	c := gpuConfig(shared(claim("mps", "gpu-0"), ""), `"sharing":{"strategy":"MPS"}`)
	if _, err := m.Prepare(context.Background(), c); err == nil || !strings.Contains(err.Error(), "MPS is not available on a GPU that independent claims share") {
		t.Errorf("MPS on a time-sliced GPU: %v", err)
	}
	if len(m.PreparedClaims()) != 0 || len(e.node.Calls()) != 0 {
		t.Errorf("refused claim left state: claims %v, NVML calls %v", m.PreparedClaims(), e.node.Calls())
	}
}

// rewindToStarted sets a prepared claim back to its started mark in the
// checkpoint on disk, as a crash between the two marks would leave it, and
// returns its record.
func (e *env) rewindToStarted(c *resourceapi.ResourceClaim) checkpoint.Claim {
	e.t.Helper()
	ck, err := checkpoint.NewStore(e.dataDir)
	if err != nil {
		e.t.Fatal(err)
	}
	data, err := ck.Load()
	if err != nil {
		e.t.Fatal(err)
	}
	rec := data.Claims[string(c.UID)]
	rec.Phase = checkpoint.PrepareStarted
	data.Claims[string(c.UID)] = rec
	if err := ck.Save(data); err != nil {
		e.t.Fatal(err)
	}
	return rec
}

// stopFailingMPS is fakeMPS whose Stop fails while failing is set, as when
// the API server does not answer the daemon pod's deletion.
type stopFailingMPS struct {
	*fakeMPS
	failing atomic.Bool
}

func (f *stopFailingMPS) Stop(ctx context.Context, d checkpoint.MPSDaemon) error {
	if f.failing.Load() {
		return fmt.Errorf("delete pod %s: the server is currently unable to handle the request", d.Pod)
	}
	return f.fakeMPS.Stop(ctx, d)
}

// TestAPrepareAfterAnUnfinishedUnprepareFinishesItFirst: an unprepare that
// failed at its daemon's stop leaves the claim UnprepareStarted, its
// partition in place; a prepare of the claim (a new pod of a shared claim)
// finishes that unprepare first, then prepares afresh, instead of
// overwriting the record and leaving the partition without one.
func TestAPrepareAfterAnUnfinishedUnprepareFinishesItFirst(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t, "dgx-h100")
	mps := &stopFailingMPS{fakeMPS: &fakeMPS{dir: t.TempDir()}}
	e.mps = mps
	m := e.start()
	c := withConfig(claim("shared", "gpu-2-mig-1g10gb-6"), driverName, `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"MigDeviceConfig","sharing":{"strategy":"MPS"}}`)
	if _, err := m.Prepare(ctx, c); err != nil {
		t.Fatal(err)
	}
	mps.failing.Store(true)
	if err := m.Unprepare(ctx, c.UID); err == nil {
		t.Fatal("the unprepare succeeded although the daemon could not be stopped")
	}
	if got := m.PreparedClaims()[c.UID]; got.Phase != checkpoint.UnprepareStarted {
		t.Fatalf("after the failed unprepare the claim is %+v, want UnprepareStarted", got)
	}
	mps.failing.Store(false)
	devs, err := m.Prepare(ctx, c)
	if err != nil {
		t.Fatalf("the prepare after the unfinished unprepare: %v", err)
	}
	if got := m.PreparedClaims()[c.UID]; got.Phase != checkpoint.PrepareCompleted || got.Devices[0].MIG == nil || got.Devices[0].MIG.UUID == "" {
		t.Errorf("the claim is recorded %+v, want prepared with its partition's UUID", got)
	}
	if n := e.node.GPUInstances(2); n != 1 {
		t.Errorf("GPU 2 has %d MIG instances, want the claim's one", n)
	}
	if r := mps.Running(); !slices.Equal(r, []string{"tessera-mps-uid-shared"}) {
		t.Errorf("daemons running %v, want the claim's one", r)
	}
	containerEnv(t, e.cdiDir, devs) // the spec resolves
	if err := m.Unprepare(ctx, c.UID); err != nil {
		t.Fatal(err)
	}
	if n := e.node.GPUInstances(2); n != 0 {
		t.Errorf("GPU 2 has %d MIG instances after the unprepare, want none", n)
	}
	if r := mps.Running(); len(r) != 0 {
		t.Errorf("daemons left running: %v", r)
	}
}
