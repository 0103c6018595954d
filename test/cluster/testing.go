package cluster

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"k8s.io/klog/v2/ktesting"
)

// StartT starts a cluster for a test and stops it in t.Cleanup. The cluster's
// logs go to the test log, and on failure the tails of every component's log
// are printed, naming the test. An unusable machine fails the test: never
// skipped. Subtests that share the cluster call LogsOnFailure.
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
			t.Logf("%s failed: cluster logs in %s (a failed subtest's part of them in %s):\n%s",
				t.Name(), c.logDir(), filepath.Join(c.dir, "failed"), c.LogTails(failureTailLines))
		}
		c.Stop()
	})
	return c
}

// LogsOnFailure makes t, a test or subtest that runs on c, leave what it
// needs to be diagnosed if it fails: when t ends failed, what every
// component (control plane, kubelets, runtimes) logged while t ran is
// copied to Dir/failed/<t's name>/, and t's log names t, that dir and the
// last lines of each component's part. Call it first thing in a subtest
// of a cluster that several subtests share; StartT calls it for the test
// that starts the cluster, and keeps Dir when t failed.
func (c *Cluster) LogsOnFailure(t testing.TB) {
	t.Helper()
	started := time.Now()
	offsets := map[string]int64{}
	paths, _ := filepath.Glob(filepath.Join(c.logDir(), "*.log"))
	for _, p := range paths {
		if fi, err := os.Stat(p); err == nil {
			offsets[p] = fi.Size()
		}
	}
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		dir := filepath.Join(c.dir, "failed", strings.NewReplacer("/", "__", " ", "_").Replace(t.Name()))
		parts, err := c.copyLogsSince(dir, offsets)
		if err != nil {
			t.Logf("%s failed; copying its part of the cluster's logs: %v (whole logs in %s)", t.Name(), err, c.logDir())
		}
		var b strings.Builder
		for _, p := range parts {
			fmt.Fprintf(&b, "==== last %d lines of %s\n%s\n", failureTailLines, p, tail(p, failureTailLines))
		}
		t.Logf("%s failed (ran %s to %s): what the cluster's components logged meanwhile is in %s (whole logs in %s)\n%s",
			t.Name(), started.Format(time.TimeOnly), time.Now().Format(time.TimeOnly), dir, c.logDir(), b.String())
	})
}

// failureTailLines is how many lines of each component's log a failed
// test prints.
const failureTailLines = 30

// copyLogsSince copies each component log's bytes after its offset in
// offsets (all of a log not there) to a file of the same name in dir, and
// returns the paths of the copies that are not empty.
func (c *Cluster) copyLogsSince(dir string, offsets map[string]int64) ([]string, error) {
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return nil, fmt.Errorf("create %s: %w", dir, err)
	}
	paths, err := filepath.Glob(filepath.Join(c.logDir(), "*.log"))
	if err != nil {
		return nil, fmt.Errorf("list the logs in %s: %w", c.logDir(), err)
	}
	sort.Strings(paths)
	var copies []string
	var errs []error
	for _, p := range paths {
		dst := filepath.Join(dir, filepath.Base(p))
		n, err := copyFrom(p, offsets[p], dst)
		if err != nil {
			errs = append(errs, err)
		}
		if n > 0 {
			copies = append(copies, dst)
		}
	}
	return copies, errors.Join(errs...)
}

// copyFrom copies src from offset on to dst and returns how many bytes it
// copied.
func copyFrom(src string, offset int64, dst string) (int64, error) {
	in, err := os.Open(src)
	if err != nil {
		return 0, fmt.Errorf("open %s: %w", src, err)
	}
	defer func() { _ = in.Close() }()
	if _, err := in.Seek(offset, io.SeekStart); err != nil {
		return 0, fmt.Errorf("seek %s to %d: %w", src, offset, err)
	}
	out, err := os.Create(dst)
	if err != nil {
		return 0, fmt.Errorf("create %s: %w", dst, err)
	}
	n, err := io.Copy(out, in)
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return n, fmt.Errorf("copy %s to %s: %w", src, dst, err)
	}
	return n, nil
}
