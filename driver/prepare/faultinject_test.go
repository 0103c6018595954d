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

	"github.com/google/go-cmp/cmp"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"

	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/domain"
	"github.com/tessera-dev/tessera/driver/prepare"
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
	// writes is how many checkpoint writes the claim's prepare makes:
	// the started mark (only a claim with something to undo has one),
	// one per undoable step recorded before it is taken (the partition
	// made, a GPU setting's original), and the completed mark.
	writes int
}

// crashClaims are the kinds of claim each failpoint is tried with: GPU
// claims on gpu-0 of a DGX H100 (switchable into and out of MIG mode), and
// a gang's domain claim on channel 0 of the node's NVLink domain.
var crashClaims = []crashKind{
	// Nothing to undo but its CDI spec: the completed mark alone.
	{"whole GPU", wholeGPU, "gpu-0", "", 1},
	// Started, the partition made, completed.
	{"MIG partition", partition, part, "", 3},
	// Started, the GPU's original power limit, completed.
	{"power-capped GPU", powerCapped, "gpu-0", `"powerLimitWatts":400`, 3},
	// Started, the GPU's original compute mode, completed.
	{"MPS GPU", mps, "gpu-0", `"sharing":{"strategy":"MPS"}`, 3},
	// Started (before the IMEX daemon starts), completed.
	{"gang NVLink domain", gangDomain, domain.DeviceName(0), "", 2},
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
