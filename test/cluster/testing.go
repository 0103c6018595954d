package cluster

import (
	"os"
	"testing"

	"k8s.io/klog/v2/ktesting"
)

// StartT starts a cluster for a test and stops it in t.Cleanup. The cluster's
// logs go to the test log, and on failure the tails of every component's log
// are printed. An unusable machine fails the test: never skipped.
//
// When opts.Dir is empty a short temporary dir is used (t.TempDir paths can
// be too long for unix sockets) and removed afterwards unless the test
// failed or TESSERA_KEEP_CLUSTER_DIR is set, so that its logs can be read.
func StartT(t testing.TB, opts Options) *Cluster {
	t.Helper()
	_, ctx := ktesting.NewTestContext(t)
	if opts.Dir == "" {
		dir, err := os.MkdirTemp("", "tessera-")
		if err != nil {
			t.Fatalf("create cluster dir: %v", err)
		}
		opts.Dir = dir
		t.Cleanup(func() {
			if t.Failed() || os.Getenv("TESSERA_KEEP_CLUSTER_DIR") != "" {
				t.Logf("cluster dir kept for inspection: %s", dir)
				return
			}
			if err := os.RemoveAll(dir); err != nil {
				t.Errorf("remove cluster dir: %v", err)
			}
		})
	}
	c, err := Start(ctx, opts)
	if err != nil {
		t.Fatalf("%v", err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("cluster logs in %s:\n%s", c.logDir(), c.LogTails(30))
		}
		c.Stop()
	})
	return c
}
