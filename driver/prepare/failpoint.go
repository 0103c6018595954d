//go:build !faultinject

package prepare

// failpoint marks a named failure point (failpoint_names.go). Outside test
// builds it does nothing, and the compiler drops the call.
func failpoint(string) {}
