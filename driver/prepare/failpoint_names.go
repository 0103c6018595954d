package prepare

// The named failure points: each marks the moment just after one step of
// prepare or unprepare has taken effect, where a crash leaves the node
// between two states the contract (state.go) must recover from. Test builds
// (-tags faultinject) can make the process "die" at any of them; in the
// default build they compile to nothing.
const (
	fpPrepareStarted     = "after-prepare-started"     // PrepareStarted mark persisted
	fpMIGCreate          = "after-mig-create"          // a claim's MIG partition exists, not yet recorded beyond its placement
	fpCDIWrite           = "after-cdi-write"           // the claim's CDI spec is on disk
	fpPrepareCompleted   = "after-prepare-completed"   // PrepareCompleted mark persisted
	fpUnprepareStarted   = "after-unprepare-started"   // UnprepareStarted mark persisted
	fpCDIRemove          = "after-cdi-remove"          // the claim's CDI spec is gone
	fpMIGDestroy         = "after-mig-destroy"         // one recorded MIG partition is gone (also reached by rollbacks)
	fpUnprepareCompleted = "after-unprepare-completed" // the claim has left the checkpoint, on disk
)
