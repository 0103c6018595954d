// Package e2e runs Tessera against a real local cluster (test/cluster):
// real apiserver, scheduler, controller manager and kubelets with a fake
// container runtime. Tests fail, never skip, when the machine cannot run it.
//
// Every test that starts a cluster runs beside the others (t.Parallel), as
// many at once as go test's -parallel allows (at least minParallel): each
// has a cluster of its own (its dir, free ports, its own pod network), and
// they spend most of their time waiting on the components' timers (the
// kubelet's slice wipe, the controllers' graces and back-offs), not on the
// CPU. Subtests of one test share its cluster and run in order.
package e2e

import (
	"flag"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"testing"

	"github.com/tessera-dev/tessera/deployments/rbac"
	"github.com/tessera-dev/tessera/test/cluster"
)

// minParallel is how many tests run at once, at least, unless -parallel
// says otherwise (go test's default, GOMAXPROCS, is 2 on a two-core CI
// machine): the tests wait far more than they compute, and with two at once
// the longest (TestGangPlacement) holds one slot while every other test
// queues for the second.
const minParallel = 4

// TestMain builds the cluster binaries if needed (the first run takes
// ~15 minutes on two cores; later runs find them cached), then checks that
// this machine can run a cluster. Set TESSERA_E2E_NO_BUILD=1 to skip the
// build step, e.g. when `make cluster-bins` already ran.
//
// A run of the whole package (no -run or -skip) starts building Tessera's
// image at once, in the background (startTesseraImageBuild).
//
// After a passing run of the whole package it checks that
// every verb the plugin's and controller's roles grant was used by some test
// (checkRoleUse); a filtered run says the check was skipped.
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
	auditDir, err := os.MkdirTemp("", "tessera-audit-")
	if err != nil {
		fmt.Fprintf(os.Stderr, "FAIL: e2e: create the audit log dir: %v\n", err)
		os.Exit(1)
	}
	cluster.AuditServiceAccounts(rbac.Namespace, auditDir)
	if imageDir, err = os.MkdirTemp("", "tessera-image-"); err != nil {
		fmt.Fprintf(os.Stderr, "FAIL: e2e: create the dir of Tessera's image: %v\n", err)
		os.Exit(1)
	}
	flag.Parse()
	if given := false; runtime.GOMAXPROCS(0) < minParallel {
		flag.Visit(func(f *flag.Flag) { given = given || f.Name == "test.parallel" })
		if !given {
			_ = flag.Set("test.parallel", strconv.Itoa(minParallel))
		}
	}
	filtered := flag.Lookup("test.run").Value.String() + flag.Lookup("test.skip").Value.String()
	if filtered == "" && flag.Lookup("test.list").Value.String() == "" {
		startTesseraImageBuild()
	}
	code := m.Run()
	_ = os.RemoveAll(imageDir)
	switch {
	case code != 0:
		fmt.Fprintf(os.Stderr, "e2e: the roles' use was not checked: tests failed (audit logs kept in %s)\n", auditDir)
		os.Exit(code)
	case filtered != "":
		fmt.Fprintln(os.Stderr, "e2e: the roles' use was not checked: only a run of the whole package exercises every rule")
	case !checkRoleUse(os.Stderr, auditDir):
		fmt.Fprintf(os.Stderr, "e2e: audit logs kept in %s\n", auditDir)
		os.Exit(1)
	}
	_ = os.RemoveAll(auditDir)
	os.Exit(code)
}
