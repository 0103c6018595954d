//go:build faultinject

package prepare_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/google/go-cmp/cmp"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/klog/v2"
	"k8s.io/klog/v2/ktesting"

	"github.com/tessera-dev/tessera/cdi"
	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/mig"
	"github.com/tessera-dev/tessera/driver/prepare"
)

// A crash is a failpoint's panic, recovered: the Manager that reached it is
// abandoned mid-operation, as a killed process leaves it, and a new Manager
// is built over the same checkpoint, CDI directory and GPUs. Each claim must
// end prepared exactly once or cleanly unprepared, whatever step it died at.

// crashClaims are the kinds of claim each failpoint is tried with, both on
// gpu-0 of a DGX H100 (switchable into and out of MIG mode).
var crashClaims = []struct {
	kind      string
	device    string
	partition bool
}{
	{"whole GPU", "gpu-0", false},
	{"MIG partition", part, true},
}

const (
	rollbackLog = "Rolling back a prepare interrupted by a crash"
	finishLog   = "Finishing an unprepare interrupted by a crash"
)

var prepareCrashes = []struct {
	point string
	// wholeReaches says whether a whole-GPU claim passes the point;
	// a partition claim passes every one.
	wholeReaches bool
	// kept: the claim survives the restart prepared (the crash came after
	// its completed mark); otherwise the restart rolls it back.
	kept bool
	// wholeSpecLeft: a whole-GPU claim has no started mark on disk (it has
	// nothing but its CDI spec to undo), so a restart finds no record of it,
	// only, past this point, its spec, which it removes as an orphan.
	wholeSpecLeft bool
}{
	{"after-prepare-started", true, false, false},
	{"after-mig-create", false, false, false},
	{"after-cdi-write", true, false, true},
	{"after-prepare-completed", true, true, false},
}

var unprepareCrashes = []struct {
	point        string
	wholeReaches bool
	// unfinished: the claim is still in the checkpoint, so the restart
	// finishes its unprepare.
	unfinished bool
}{
	{"after-unprepare-started", true, true},
	{"after-cdi-remove", true, true},
	{"after-mig-destroy", false, true},
	{"after-unprepare-completed", true, false},
}

func TestEveryFailpointIsTriedByTheCrashTests(t *testing.T) {
	var tried []string
	for _, c := range prepareCrashes {
		tried = append(tried, c.point)
	}
	for _, c := range unprepareCrashes {
		tried = append(tried, c.point)
	}
	if diff := cmp.Diff(prepare.Failpoints(), tried); diff != "" {
		t.Errorf("failpoints (-declared +tried):\n%s", diff)
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

func TestAPrepareCrashedAtAnyStepConvergesAfterRestart(t *testing.T) {
	for _, tc := range prepareCrashes {
		for _, k := range crashClaims {
			t.Run(tc.point+" on a "+k.kind+" claim", func(t *testing.T) {
				defer prepare.DisarmFailpoints()
				e := newEnv(t, "dgx-h100")
				ctx := context.Background()
				c := claim("crash", k.device)
				reached := tc.wholeReaches || k.partition

				old := e.start()
				prepare.ArmFailpoint(tc.point)
				crashedAt(t, reached, tc.point, func() error { _, err := old.Prepare(ctx, c); return err })
				prepare.DisarmFailpoints()

				m, logs := restart(t, e)
				switch {
				case !reached || tc.kept:
					assertRestartSettledNothing(t, logs)
					assertPrepared(t, e, m, c, k.partition)
				case !k.partition:
					assertRestartRemovedOnlyTheSpec(t, logs, tc.wholeSpecLeft)
					assertUnprepared(t, e, m, c)
				default:
					assertRestartSettled(t, logs, rollbackLog)
					assertUnprepared(t, e, m, c)
				}

				// The kubelet retries the prepare, and later unprepares.
				devs, err := m.Prepare(ctx, c)
				if err != nil {
					t.Fatalf("retried prepare: %v", err)
				}
				ids := assertPrepared(t, e, m, c, k.partition)
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

func TestAnUnprepareCrashedAtAnyStepConvergesAfterRestart(t *testing.T) {
	for _, tc := range unprepareCrashes {
		for _, k := range crashClaims {
			t.Run(tc.point+" on a "+k.kind+" claim", func(t *testing.T) {
				defer prepare.DisarmFailpoints()
				e := newEnv(t, "dgx-h100")
				ctx := context.Background()
				c := claim("crash", k.device)
				reached := tc.wholeReaches || k.partition

				old := e.start()
				if _, err := old.Prepare(ctx, c); err != nil {
					t.Fatal(err)
				}
				prepare.ArmFailpoint(tc.point)
				crashedAt(t, reached, tc.point, func() error { return old.Unprepare(ctx, c.UID) })
				prepare.DisarmFailpoints()

				m, logs := restart(t, e)
				if reached && tc.unfinished {
					assertRestartSettled(t, logs, finishLog)
				} else {
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

// assertPrepared checks the claim is prepared exactly once and returns its
// CDI device IDs.
func assertPrepared(t *testing.T, e *env, m *prepare.Manager, c *resourceapi.ResourceClaim, partition bool) []string {
	t.Helper()
	dev := c.Status.Allocation.Devices.Results[0].Device
	got, ok := m.PreparedClaims()[c.UID]
	if !ok || got.Phase != checkpoint.PrepareCompleted || len(got.Devices) != 1 || got.Devices[0].Device != dev {
		t.Fatalf("claim in memory: %+v (present %v), want %s prepared", got, ok, dev)
	}
	disk := load(t, e.dataDir)
	if len(disk.Claims) != 1 || disk.Claims[string(c.UID)].Phase != checkpoint.PrepareCompleted {
		t.Errorf("checkpoint on disk: %+v, want only this claim, completed", disk.Claims)
	}
	store, err := cdi.NewStore(e.cdiDir)
	if err != nil {
		t.Fatal(err)
	}
	if f := specFiles(t, e.cdiDir); len(f) != 1 || f[0] != store.Path(string(c.UID)) {
		t.Errorf("CDI specs %v, want only %s", f, store.Path(string(c.UID)))
	}
	ids := got.Devices[0].CDIDeviceIDs
	inject(t, e.cdiDir, ids...) // fails the test if the spec does not serve the IDs

	insts := instances(t, e)
	if partition {
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

	_, err = m.Prepare(context.Background(), claim("intruder", dev))
	if err == nil || !strings.Contains(err.Error(), "already prepared for claim default/crash") {
		t.Errorf("another claim for %s: got %v, want refused as held by default/crash", dev, err)
	}
	return ids
}

// assertUnprepared checks nothing of the claim is left and its device is
// usable by another claim.
func assertUnprepared(t *testing.T, e *env, m *prepare.Manager, c *resourceapi.ResourceClaim) {
	t.Helper()
	if got, ok := m.PreparedClaims()[c.UID]; ok {
		t.Errorf("claim still held in memory: %+v", got)
	}
	assertNodeClean(t, e)

	ctx := context.Background()
	dev := c.Status.Allocation.Devices.Results[0].Device
	next := claim("next", dev)
	if _, err := m.Prepare(ctx, next); err != nil {
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
