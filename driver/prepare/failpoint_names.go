package prepare

import (
	"fmt"
	"slices"
)

// The named failure points: each marks the moment just after one step of
// prepare, unprepare or a rolling update's reload has taken effect, where a
// crash leaves the node between two states the contract (state.go) must
// recover from. Test builds (-tags faultinject) can make the process "die"
// at any of them; in the default build the calls compile to nothing.
//
// These declarations are the registry: point records each name in
// failpoints, in the order a claim's life reaches them, so that no list is
// kept by hand beside them. Two tests hold the registry to the code, so
// that a new step cannot go untested:
//   - TestEveryFailpointIsDeclaredAndReached (every build) parses this
//     package's source: every call of failpoint must pass one of these
//     names, by its identifier, and every name must be passed by a call;
//   - TestEveryFailpointIsTriedByTheCrashTests (-tags faultinject) fails
//     until a crash table crashes a claim at every name.
var (
	fpPrepareStarted     = point("after-prepare-started")       // PrepareStarted mark persisted
	fpSettingChange      = point("after-gpu-setting-change")    // a GPU setting a claim needs is applied, its original recorded
	fpMIGCreate          = point("after-mig-create")            // a claim's MIG partition exists, not yet recorded beyond its placement
	fpMPSStart           = point("after-mps-start")             // a claim's MPS daemon serves, its location recorded
	fpCDIWrite           = point("after-cdi-write")             // the claim's CDI spec is on disk
	fpIMEXStart          = point("after-imex-start")            // a domain claim's IMEX daemon is ready, its location recorded
	fpPrepareCompleted   = point("after-prepare-completed")     // PrepareCompleted mark persisted
	fpUnprepareStarted   = point("after-unprepare-started")     // UnprepareStarted mark persisted
	fpCDIRemove          = point("after-cdi-remove")            // the claim's CDI spec is gone
	fpMPSStop            = point("after-mps-stop")              // a claim's MPS daemon is stopped (also reached by rollbacks)
	fpIMEXStop           = point("after-imex-stop")             // a domain claim's IMEX daemon is stopped (also reached by rollbacks)
	fpMIGDestroy         = point("after-mig-destroy")           // one recorded MIG partition is gone (also reached by rollbacks)
	fpSettingRestore     = point("after-gpu-setting-restore")   // a GPU setting is back at its original, the record not yet dropped
	fpUnprepareCompleted = point("after-unprepare-completed")   // the claim has left the checkpoint, on disk
	fpQuarantine         = point("after-checkpoint-quarantine") // a corrupted checkpoint is set aside, not yet replaced by the rebuilt one
	fpReloadRebuilt      = point("after-reload-rebuild")        // a reload's rebuilt checkpoint is on disk
)

// failpoints is the registry: every name point declared, in order.
var failpoints []string

// point declares a failure point named name and returns the name. A name
// declared twice panics when the package is initialized.
func point(name string) string {
	if slices.Contains(failpoints, name) {
		panic(fmt.Sprintf("failpoint %q declared twice", name))
	}
	failpoints = append(failpoints, name)
	return name
}
