//go:build faultinject

package prepare_test

import (
	"context"
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/google/go-cmp/cmp"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
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

// A crash is a failpoint's panic, recovered: the Manager that reached it is
// abandoned mid-operation, as a killed process leaves it, and a new Manager
// is built over the same checkpoint, CDI directory and GPUs. Each claim must
// end prepared exactly once or cleanly unprepared, whatever step it died at.

// A claim kind, as a bit so that a failpoint can say which kinds reach it.
type kind uint8

const (
	wholeGPU kind = 1 << iota
	partition
	powerCapped
	mps
	gangDomain // a gang's NVLink domain claim: its prepare starts an IMEX daemon
	everyKind  = wholeGPU | partition | powerCapped | mps | gangDomain
)

// crashKind is a kind of claim each failpoint is tried with.
type crashKind struct {
	name   string
	kind   kind
	device string
	config string // the claim's GpuConfig fields, if any
}

// crashClaims are the kinds of claim each failpoint is tried with: GPU
// claims on gpu-0 of a DGX H100 (switchable into and out of MIG mode), and
// a gang's domain claim on channel 0 of the node's NVLink domain.
var crashClaims = []crashKind{
	{"whole GPU", wholeGPU, "gpu-0", ""},
	{"MIG partition", partition, part, ""},
	{"power-capped GPU", powerCapped, "gpu-0", `"powerLimitWatts":400`},
	{"MPS GPU", mps, "gpu-0", `"sharing":{"strategy":"MPS"}`},
	{"gang NVLink domain", gangDomain, domain.DeviceName(0), ""},
}

// claim is the kind's claim named name.
func (k crashKind) claim(name string) *resourceapi.ResourceClaim {
	if k.kind == gangDomain {
		return gangDomainClaim(name)
	}
	return crashClaim(name, k.device, k.config)
}

// gangDomainClaim is a two-node gang's domain claim on channel 0 of an
// NVLink domain, placed by the gang controller: preparing it starts the
// node's IMEX daemon for it.
func gangDomainClaim(name string) *resourceapi.ResourceClaim {
	return nvlinkClaim(name, "tray-1=10.0.0.1,"+nodeName+"=10.0.0.2")
}

// imexPod is where the fake IMEX daemons run a claim's daemon.
func imexPod(uid types.UID) string { return "tessera-imex-" + string(uid) }

// prepareClaim prepares c through m as the plugin does: a claim of gang
// domain devices through PrepareDomain, with the domain preparer.
func (e *env) prepareClaim(ctx context.Context, m *prepare.Manager, c *resourceapi.ResourceClaim) ([]kubeletplugin.Device, error) {
	if domain.Has(driverName, c) {
		return m.PrepareDomain(ctx, c, e.nvlinkPreparer().Prepare)
	}
	return m.Prepare(ctx, c)
}

// crashClaim is a GPU claim of device with the GpuConfig fields config, if
// any.
func crashClaim(name, device, config string) *resourceapi.ResourceClaim {
	c := claim(name, device)
	if config != "" {
		c = gpuConfig(c, config)
	}
	return c
}

const (
	rollbackLog = "Rolling back a prepare interrupted by a crash"
	finishLog   = "Finishing an unprepare interrupted by a crash"
)

var prepareCrashes = []struct {
	point string
	// reachedBy are the kinds of claim whose prepare passes the point.
	reachedBy kind
	// kept: the claim survives the restart prepared (the crash came after
	// its completed mark); otherwise the restart rolls it back.
	kept bool
	// wholeSpecLeft: a plain whole-GPU claim has no started mark on disk
	// (it has nothing but its CDI spec to undo), so a restart finds no
	// record of it, only, past this point, its spec, which it removes as an
	// orphan.
	wholeSpecLeft bool
}{
	{"after-prepare-started", everyKind, false, false},
	{"after-gpu-setting-change", powerCapped | mps, false, false},
	{"after-mig-create", partition, false, false},
	{"after-mps-start", mps, false, false},
	{"after-cdi-write", everyKind, false, true},
	{"after-imex-start", gangDomain, false, false},
	{"after-prepare-completed", everyKind, true, false},
}

var unprepareCrashes = []struct {
	point     string
	reachedBy kind
	// unfinished: the claim is still in the checkpoint, so the restart
	// finishes its unprepare.
	unfinished bool
	// specLeft: the kinds whose spec outlives their record (a claim with
	// nothing to undo but its spec leaves the checkpoint first), which the
	// restart removes as an orphan.
	specLeft kind
}{
	// A whole-GPU claim has nothing to undo but its spec: no started mark.
	{"after-unprepare-started", everyKind &^ wholeGPU, true, 0},
	{"after-cdi-remove", everyKind &^ wholeGPU, true, 0},
	{"after-mps-stop", mps, true, 0},
	{"after-imex-stop", gangDomain, true, 0},
	{"after-mig-destroy", partition, true, 0},
	{"after-gpu-setting-restore", powerCapped | mps, true, 0},
	{"after-unprepare-completed", everyKind, false, wholeGPU},
}

// reloadCrashes are tried on a rolling update's reload of a corrupted
// checkpoint, with a claim of each kind, which a rebuild from the CDI specs
// recovers whole.
var reloadCrashes = []string{"after-checkpoint-quarantine", "after-reload-rebuild"}

// TestEveryFailpointIsTriedByTheCrashTests: every failure point the code
// has (the registry, which TestEveryFailpointIsDeclaredAndReached keeps
// equal to the failpoint calls in the source) is armed by a crash table
// row that some claim kind reaches, and the crash tests fail a case whose
// operation does not die at the point its row says it reaches (crashedAt).
// A new step's failpoint fails this test until a table crashes a claim
// there.
func TestEveryFailpointIsTriedByTheCrashTests(t *testing.T) {
	tried := map[string]bool{}
	try := func(point string, reachedBy kind) {
		if reachedBy&everyKind == 0 {
			t.Errorf("crash table row %s: no claim kind reaches it, so no case crashes there", point)
		}
		tried[point] = true
	}
	for _, c := range prepareCrashes {
		try(c.point, c.reachedBy)
	}
	for _, c := range unprepareCrashes {
		try(c.point, c.reachedBy)
	}
	for _, p := range reloadCrashes {
		try(p, everyKind)
	}
	declared := prepare.Failpoints()
	slices.Sort(declared)
	if diff := cmp.Diff(declared, slices.Sorted(maps.Keys(tried))); diff != "" {
		t.Errorf("failpoints (-declared +tried by a crash table):\n%s", diff)
	}
}

func TestArmingAnUnknownFailpointPanics(t *testing.T) {
	defer func() {
		if r := recover(); r == nil || !strings.Contains(fmt.Sprint(r), "after-prepare-starte") {
			t.Errorf("got %v, want a panic naming the bad point", r)
		}
	}()
	prepare.ArmFailpoint("after-prepare-starte")
}

// modes are how a node is served: by one instance, or by two in a rolling
// update, where every change of the state takes the node lock and a crash
// releases it.
var modes = []struct {
	name    string
	rolling bool
}{{"", false}, {" in a rolling update", true}}

func TestAPrepareCrashedAtAnyStepConvergesAfterRestart(t *testing.T) {
	for _, tc := range prepareCrashes {
		for _, k := range crashClaims {
			for _, mode := range modes {
				t.Run(tc.point+" on a "+k.name+" claim"+mode.name, func(t *testing.T) {
					defer prepare.DisarmFailpoints()
					e := newCrashEnv(t)
					e.rolling = mode.rolling
					ctx := context.Background()
					c := k.claim("crash")
					reached := tc.reachedBy&k.kind != 0

					old := e.start()
					prepare.ArmFailpoint(tc.point)
					crashedAt(t, reached, tc.point, func() error { _, err := e.prepareClaim(ctx, old, c); return err })
					prepare.DisarmFailpoints()

					m, logs := restart(t, e)
					switch {
					case !reached || tc.kept:
						assertRestartSettledNothing(t, logs)
						assertPrepared(t, e, m, c, k.kind)
					case k.kind == wholeGPU && !mode.rolling:
						// In a rolling update its started mark is on disk:
						// it tells the other instance the GPU is taken.
						assertRestartRemovedOnlyTheSpec(t, logs, tc.wholeSpecLeft)
						assertUnprepared(t, e, m, c)
					default:
						assertRestartSettled(t, logs, rollbackLog)
						assertUnprepared(t, e, m, c)
					}

					// The kubelet retries the prepare, and later unprepares.
					devs, err := e.prepareClaim(ctx, m, c)
					if err != nil {
						t.Fatalf("retried prepare: %v", err)
					}
					ids := assertPrepared(t, e, m, c, k.kind)
					if len(devs) != 1 || !slices.Equal(devs[0].CDIDeviceIDs, ids) {
						t.Errorf("retried prepare returned %+v, want the recorded CDI IDs %v", devs, ids)
					}
					if err := m.Unprepare(ctx, c.UID); err != nil {
						t.Fatalf("unprepare: %v", err)
					}
					assertUnprepared(t, e, m, c)
				})
			}
		}
	}
}

func TestAnUnprepareCrashedAtAnyStepConvergesAfterRestart(t *testing.T) {
	for _, tc := range unprepareCrashes {
		for _, k := range crashClaims {
			for _, mode := range modes {
				t.Run(tc.point+" on a "+k.name+" claim"+mode.name, func(t *testing.T) {
					defer prepare.DisarmFailpoints()
					e := newCrashEnv(t)
					e.rolling = mode.rolling
					ctx := context.Background()
					c := k.claim("crash")
					reached := tc.reachedBy&k.kind != 0

					old := e.start()
					if _, err := e.prepareClaim(ctx, old, c); err != nil {
						t.Fatal(err)
					}
					prepare.ArmFailpoint(tc.point)
					crashedAt(t, reached, tc.point, func() error { return old.Unprepare(ctx, c.UID) })
					prepare.DisarmFailpoints()

					m, logs := restart(t, e)
					switch {
					case reached && tc.unfinished:
						assertRestartSettled(t, logs, finishLog)
					case reached && tc.specLeft&k.kind != 0:
						assertRestartRemovedOnlyTheSpec(t, logs, true)
					default:
						assertRestartSettledNothing(t, logs)
					}
					assertUnprepared(t, e, m, c)

					// The kubelet never saw the unprepare succeed: it retries.
					if err := m.Unprepare(ctx, c.UID); err != nil {
						t.Fatalf("retried unprepare: %v", err)
					}
					assertUnprepared(t, e, m, c)
				})
			}
		}
	}
}

// A rolling update's reload that finds the checkpoint corrupted and dies
// while rebuilding it: the restart still knows the prepared claim, the
// kubelet's retry of the call the reload began (a prepare of another claim)
// is served afresh, and both claims unprepare cleanly.
func TestAReloadCrashedAtAnyStepConvergesAfterRestart(t *testing.T) {
	for _, point := range reloadCrashes {
		for _, k := range crashClaims {
			t.Run(point+" with a "+k.name+" claim prepared", func(t *testing.T) {
				defer prepare.DisarmFailpoints()
				e := newCrashEnv(t)
				ctx := context.Background()
				c := k.claim("crash")

				old := e.start()
				if _, err := e.prepareClaim(ctx, old, c); err != nil {
					t.Fatal(err)
				}
				writeJunk(t, e.dataDir)
				prepare.ArmFailpoint(point)
				crashedAt(t, true, point, func() error { return old.Reload(ctx) })
				prepare.DisarmFailpoints()

				m, _ := restart(t, e)
				dev := c.Status.Allocation.Devices.Results[0].Device
				assertHeld(t, m, c, k.kind)
				if d := load(t, e.dataDir); d.Claims[string(c.UID)].Phase != checkpoint.PrepareCompleted {
					t.Errorf("checkpoint on disk: %+v, want the claim completed", d.Claims)
				}
				if f := specFiles(t, e.cdiDir); len(f) != 1 {
					t.Errorf("CDI specs %v, want the claim's", f)
				}
				if n := len(instances(t, e)); n != 0 != (k.kind == partition) {
					t.Errorf("%d MIG instances with a %s claim prepared", n, k.name)
				}
				if got := e.imex.(*fakeIMEX).Running(); len(got) != 0 != (k.kind == gangDomain) {
					t.Errorf("IMEX daemons running %v with a %s claim prepared", got, k.name)
				}
				if moved, _ := filepath.Glob(filepath.Join(e.dataDir, checkpoint.FileName+".corrupt-*")); len(moved) == 0 {
					t.Error("the corrupted checkpoint was not kept aside")
				}
				if k.kind != gangDomain {
					assertRefusedToAnother(t, m, dev)
				}

				next := claim("next", "gpu-1")
				if _, err := m.Prepare(ctx, next); err != nil {
					t.Fatalf("the kubelet's retried prepare: %v", err)
				}
				for _, uid := range []types.UID{next.UID, c.UID} {
					if err := m.Unprepare(ctx, uid); err != nil {
						t.Fatalf("unprepare %s: %v", uid, err)
					}
				}
				assertUnprepared(t, e, m, c)
			})
		}
	}
}

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
