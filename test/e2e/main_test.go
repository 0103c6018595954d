// Package e2e runs Tessera against a real local cluster (test/cluster):
// real apiserver, scheduler, controller manager and kubelets with a fake
// container runtime. Tests fail, never skip, when the machine cannot run it.
package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"testing"

	"github.com/tessera-dev/tessera/test/cluster"
)

// TestMain builds the cluster binaries if needed (the first run takes
// ~15 minutes on two cores; later runs find them cached), then checks that
// this machine can run a cluster. Set TESSERA_E2E_NO_BUILD=1 to skip the
// build step, e.g. when `make cluster-bins` already ran.
func TestMain(m *testing.M) {
	cluster.StopOnInterrupt()
	if os.Getenv("TESSERA_E2E_NO_BUILD") == "" {
		build := exec.Command("../k8sbin/build.sh")
		build.Stdout, build.Stderr = os.Stderr, os.Stderr
		if err := build.Run(); err != nil {
			fmt.Fprintf(os.Stderr, "FAIL: e2e: building cluster binaries with test/k8sbin/build.sh: %v\n", err)
			os.Exit(1)
		}
	}
	if err := cluster.CheckPrerequisites(); err != nil {
		fmt.Fprintf(os.Stderr, "FAIL: e2e: this machine cannot run the end-to-end tests:\n%v\n", err)
		os.Exit(1)
	}
	os.Exit(m.Run())
}
