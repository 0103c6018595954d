package prepare

// The named failure points: each marks the moment just after one step of
// prepare, unprepare or a rolling update's reload has taken effect, where a
// crash leaves the node between two states the contract (state.go) must
// recover from. Test builds
// (-tags faultinject) can make the process "die" at any of them; in the
// default build they compile to nothing.
const (
	fpPrepareStarted     = "after-prepare-started"       // PrepareStarted mark persisted
	fpSettingChange      = "after-gpu-setting-change"    // a GPU setting a claim needs is applied, its original recorded
	fpMIGCreate          = "after-mig-create"            // a claim's MIG partition exists, not yet recorded beyond its placement
	fpMPSStart           = "after-mps-start"             // a claim's MPS daemon serves, its location recorded
	fpCDIWrite           = "after-cdi-write"             // the claim's CDI spec is on disk
	fpIMEXStart          = "after-imex-start"            // a domain claim's IMEX daemon is ready, its location recorded
	fpPrepareCompleted   = "after-prepare-completed"     // PrepareCompleted mark persisted
	fpUnprepareStarted   = "after-unprepare-started"     // UnprepareStarted mark persisted
	fpCDIRemove          = "after-cdi-remove"            // the claim's CDI spec is gone
	fpMPSStop            = "after-mps-stop"              // a claim's MPS daemon is stopped (also reached by rollbacks)
	fpIMEXStop           = "after-imex-stop"             // a domain claim's IMEX daemon is stopped (also reached by rollbacks)
	fpMIGDestroy         = "after-mig-destroy"           // one recorded MIG partition is gone (also reached by rollbacks)
	fpSettingRestore     = "after-gpu-setting-restore"   // a GPU setting is back at its original, the record not yet dropped
	fpUnprepareCompleted = "after-unprepare-completed"   // the claim has left the checkpoint, on disk
	fpQuarantine         = "after-checkpoint-quarantine" // a corrupted checkpoint is set aside, not yet replaced by the rebuilt one
	fpReloadRebuilt      = "after-reload-rebuild"        // a reload's rebuilt checkpoint is on disk
)
