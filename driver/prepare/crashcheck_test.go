//go:build faultinject

package prepare_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/klog/v2"
	"k8s.io/klog/v2/ktesting"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"

	"github.com/tessera-dev/tessera/cdi"
	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/domain"
	"github.com/tessera-dev/tessera/driver/mig"
	"github.com/tessera-dev/tessera/driver/prepare"
	"github.com/tessera-dev/tessera/test/fixtures"
)

// The crash tests' node and checks: a node every claim kind can be
// prepared on, a restart after a crash, and what must hold of a claim
// prepared, or unprepared, and of the node, after it.

// newCrashEnv is a DGX H100 in a multi-node NVLink domain (the clique of a
// GB200 tray's profile, so that it has IMEX channels) whose claims may run
// MPS daemons and whose gang domain claims run IMEX daemons (each recorded
// by a fake that knows which are running).
func newCrashEnv(t *testing.T) *env {
	p := fixtures.Profile(t, "dgx-h100")
	p.Fabric = fixtures.Profile(t, "gb200-nvl72-tray").Fabric
	e := newEnvFrom(t, p, true)
	e.mps = &fakeMPS{dir: t.TempDir()}
	e.imex = &fakeIMEX{}
	return e
}

// crashedAt runs op and checks it died at point if reached, and otherwise
// completed without error.
func crashedAt(t *testing.T, reached bool, point string, op func() error) {
	t.Helper()
	var crash *prepare.Crash
	err := func() (err error) {
		defer func() {
			if r := recover(); r != nil {
				c, ok := r.(prepare.Crash)
				if !ok {
					panic(r)
				}
				crash = &c
			}
		}()
		return op()
	}()
	switch {
	case reached && crash == nil:
		t.Fatalf("operation did not reach failpoint %s (error %v)", point, err)
	case reached && crash.Point != point:
		t.Fatalf("crashed at %s, armed %s", crash.Point, point)
	case !reached && crash != nil:
		t.Fatalf("crashed at %s, which this claim should not reach", crash.Point)
	case !reached && err != nil:
		t.Fatalf("operation failed: %v", err)
	}
}

// restart builds a new Manager over the node's disk and GPUs and returns its
// log.
func restart(t *testing.T, e *env) (*prepare.Manager, string) {
	t.Helper()
	logger := ktesting.NewLogger(t, ktesting.NewConfig(ktesting.BufferLogs(true)))
	m, err := prepare.New(klog.NewContext(context.Background(), logger), e.config())
	if err != nil {
		t.Fatalf("restart after the crash: %v", err)
	}
	return m, logger.GetSink().(ktesting.Underlier).GetBuffer().String()
}

// orphanLogs are what a restart logs when the checkpoint did not account for
// something on the node: after a crash at a failpoint it always should.
var orphanLogs = []string{"no prepared claim owns"}

func assertRestartSettled(t *testing.T, logs, want string) {
	t.Helper()
	if !strings.Contains(logs, want) || !strings.Contains(logs, `uid="uid-crash"`) {
		t.Errorf("restart did not log %q for the claim; log:\n%s", want, logs)
	}
	for _, o := range orphanLogs {
		if strings.Contains(logs, o) {
			t.Errorf("restart found leftovers the checkpoint did not record; log:\n%s", logs)
		}
	}
}

// assertRestartRemovedOnlyTheSpec checks a restart after a crash of a claim
// it has no record of: nothing to roll back, and the claim's CDI spec removed
// if it was left.
func assertRestartRemovedOnlyTheSpec(t *testing.T, logs string, specLeft bool) {
	t.Helper()
	for _, o := range []string{rollbackLog, finishLog} {
		if strings.Contains(logs, o) {
			t.Errorf("restart settled a claim the checkpoint should not hold; log:\n%s", logs)
		}
	}
	removed := strings.Contains(logs, "Removing a CDI spec that no prepared claim owns") && strings.Contains(logs, `uid="uid-crash"`)
	if removed != specLeft {
		t.Errorf("restart removed the claim's orphan CDI spec: %v, want %v; log:\n%s", removed, specLeft, logs)
	}
}

func assertRestartSettledNothing(t *testing.T, logs string) {
	t.Helper()
	for _, o := range append([]string{rollbackLog, finishLog}, orphanLogs...) {
		if strings.Contains(logs, o) {
			t.Errorf("restart had something to settle; log:\n%s", logs)
		}
	}
}

// assertHeld checks the claim is held in memory as prepared, as its kind
// is recorded: with its one device, or as a domain claim with its IMEX
// daemon.
func assertHeld(t *testing.T, m *prepare.Manager, c *resourceapi.ResourceClaim, k kind) checkpoint.Claim {
	t.Helper()
	got, ok := m.PreparedClaims()[c.UID]
	if k == gangDomain {
		if !ok || got.Phase != checkpoint.PrepareCompleted || !got.Domain || got.IMEX == nil || got.IMEX.Pod != imexPod(c.UID) {
			t.Fatalf("claim in memory: %+v (present %v), want a prepared domain claim with its IMEX daemon %s", got, ok, imexPod(c.UID))
		}
		return got
	}
	dev := c.Status.Allocation.Devices.Results[0].Device
	if !ok || got.Phase != checkpoint.PrepareCompleted || len(got.Devices) != 1 || got.Devices[0].Device != dev {
		t.Fatalf("claim in memory: %+v (present %v), want %s prepared", got, ok, dev)
	}
	return got
}

// assertPrepared checks the claim is prepared exactly once, with what its
// kind changes on the GPU and the daemons it runs, and returns its CDI
// device IDs: those recorded, or for a domain claim (whose record keeps
// none) those its spec serves.
func assertPrepared(t *testing.T, e *env, m *prepare.Manager, c *resourceapi.ResourceClaim, k kind) []string {
	t.Helper()
	dev := c.Status.Allocation.Devices.Results[0].Device
	got := assertHeld(t, m, c, k)
	disk := load(t, e.dataDir)
	if len(disk.Claims) != 1 || disk.Claims[string(c.UID)].Phase != checkpoint.PrepareCompleted {
		t.Errorf("checkpoint on disk: %+v, want only this claim, completed", disk.Claims)
	}
	store, err := cdi.NewStore(e.cdiDir)
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	if k == gangDomain {
		store = e.domainPreparer().CDI
		if rec := disk.Claims[string(c.UID)]; !rec.Domain || rec.IMEX == nil || rec.IMEX.Pod != imexPod(c.UID) {
			t.Errorf("checkpoint on disk records %+v, want a domain claim with its IMEX daemon %s", rec, imexPod(c.UID))
		}
		ids = specDeviceIDs(t, e.cdiDir)
	} else {
		ids = got.Devices[0].CDIDeviceIDs
	}
	if f := specFiles(t, e.cdiDir); len(f) != 1 || f[0] != store.Path(string(c.UID)) {
		t.Errorf("CDI specs %v, want only %s", f, store.Path(string(c.UID)))
	}
	inject(t, e.cdiDir, ids...) // fails the test if the spec does not serve the IDs

	insts := instances(t, e)
	if k == partition {
		rec := got.Devices[0].MIG
		if len(insts) != 1 || rec == nil || insts[0].Placement.Start != rec.Start || insts[0].UUID != rec.UUID {
			t.Errorf("MIG instances %+v, want exactly the recorded partition %+v", insts, rec)
		}
		if !migMode(t, e) {
			t.Error("GPU not in MIG mode with a partition prepared")
		}
	} else {
		if len(insts) != 0 || migMode(t, e) {
			t.Errorf("whole GPU prepared with MIG mode %v and instances %+v", migMode(t, e), insts)
		}
	}

	if got, want := e.node.PowerLimitMW(0), gpu0PowerMW; k == powerCapped && got != 400000 || k != powerCapped && got != want {
		t.Errorf("gpu-0 power limit %d mW with a %s claim prepared", got, kindName(k))
	}
	if got := e.node.ComputeMode(0); (got == nvml.COMPUTEMODE_EXCLUSIVE_PROCESS) != (k == mps) {
		t.Errorf("gpu-0 compute mode %d with a %s claim prepared", got, kindName(k))
	}
	if got := e.mps.(*fakeMPS).Running(); k == mps && !slices.Equal(got, []string{"tessera-mps-" + string(c.UID)}) || k != mps && len(got) != 0 {
		t.Errorf("MPS daemons running %v with a %s claim prepared", got, kindName(k))
	}
	if got := e.imex.(*fakeIMEX).Running(); k == gangDomain && !slices.Equal(got, []string{imexPod(c.UID)}) || k != gangDomain && len(got) != 0 {
		t.Errorf("IMEX daemons running %v with a %s claim prepared", got, kindName(k))
	}

	// The node does not hold a domain channel for one claim: the gang
	// controller alone allocates channels, one per gang (docs/gang.md).
	if k != gangDomain {
		assertRefusedToAnother(t, m, dev)
	}
	return ids
}

// assertRefusedToAnother checks another claim for dev is refused while the
// claim named crash holds it.
func assertRefusedToAnother(t *testing.T, m *prepare.Manager, dev string) {
	t.Helper()
	_, err := m.Prepare(context.Background(), claim("intruder", dev))
	if err == nil || !strings.Contains(err.Error(), "already prepared for claim default/crash") {
		t.Errorf("another claim for %s: got %v, want refused as held by default/crash", dev, err)
	}
}

// specDeviceIDs are the CDI device IDs the specs in dir serve.
func specDeviceIDs(t *testing.T, dir string) []string {
	t.Helper()
	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(dir), cdiapi.WithAutoRefresh(false))
	if err != nil {
		t.Fatal(err)
	}
	if errs := cache.GetErrors(); len(errs) != 0 {
		t.Fatalf("CDI specs in %s: %v", dir, errs)
	}
	return cache.ListDevices()
}

// assertUnprepared checks nothing of the claim is left and its device is
// usable by another claim (of its domain, for a domain claim).
func assertUnprepared(t *testing.T, e *env, m *prepare.Manager, c *resourceapi.ResourceClaim) {
	t.Helper()
	if got, ok := m.PreparedClaims()[c.UID]; ok {
		t.Errorf("claim still held in memory: %+v", got)
	}
	assertNodeClean(t, e)

	ctx := context.Background()
	dev := c.Status.Allocation.Devices.Results[0].Device
	next := claim("next", dev)
	if domain.Has(driverName, c) {
		next = gangDomainClaim("next")
	}
	if _, err := e.prepareClaim(ctx, m, next); err != nil {
		t.Fatalf("device %s not preparable by another claim: %v", dev, err)
	}
	if err := m.Unprepare(ctx, next.UID); err != nil {
		t.Fatal(err)
	}
	assertNodeClean(t, e)
}

func assertNodeClean(t *testing.T, e *env) {
	t.Helper()
	if d := load(t, e.dataDir); len(d.Claims) != 0 {
		t.Errorf("checkpoint still holds %+v", d.Claims)
	}
	if f := specFiles(t, e.cdiDir); len(f) != 0 {
		t.Errorf("CDI specs left: %v", f)
	}
	if insts := instances(t, e); len(insts) != 0 {
		t.Errorf("MIG instances left on gpu-0: %+v", insts)
	}
	if migMode(t, e) {
		t.Error("gpu-0 left in MIG mode with no partition")
	}
	if got := e.node.PowerLimitMW(0); got != gpu0PowerMW {
		t.Errorf("gpu-0 power limit left at %d mW, want the original %d", got, gpu0PowerMW)
	}
	if got := e.node.ComputeMode(0); got != nvml.COMPUTEMODE_DEFAULT {
		t.Errorf("gpu-0 compute mode left at %d, want Default", got)
	}
	if d := load(t, e.dataDir); len(d.GPUs) != 0 {
		t.Errorf("checkpoint still records GPU settings to restore: %+v", d.GPUs)
	}
	if running := e.mps.(*fakeMPS).Running(); len(running) != 0 {
		t.Errorf("MPS daemons left running: %v", running)
	}
	if running := e.imex.(*fakeIMEX).Running(); len(running) != 0 {
		t.Errorf("IMEX daemons left running: %v", running)
	}
}

// gpu0PowerMW is gpu-0's power limit before any claim changes it.
const gpu0PowerMW uint32 = 700000

func kindName(k kind) string {
	for _, c := range crashClaims {
		if c.kind == k {
			return c.name
		}
	}
	return fmt.Sprint(k)
}

func instances(t *testing.T, e *env) []mig.Instance {
	t.Helper()
	insts, err := e.mig.Instances(e.gpus[0].UUID)
	if err != nil {
		t.Fatal(err)
	}
	return insts
}

func migMode(t *testing.T, e *env) bool {
	t.Helper()
	d, ret := e.node.NVML.DeviceGetHandleByUUID(e.gpus[0].UUID)
	if ret != nvml.SUCCESS {
		t.Fatalf("gpu-0: %v", ret)
	}
	on, err := mig.Enabled(d)
	if err != nil {
		t.Fatal(err)
	}
	return on
}
