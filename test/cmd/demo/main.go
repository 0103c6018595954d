// Command demo shows Tessera end to end on a local cluster (test/cluster)
// with two simulated GPU nodes: a DGX H100 and a PCIe server with four L4s.
// It installs the DeviceClasses and the kubelet plugin's RBAC, runs Tessera's
// kubelet plugin for each node, applies the example workloads from
// deployments/examples, prints for each where it landed and what its
// container received, then tears everything down (also on Ctrl-C). Then it
// shows Tessera as users install it (chart.go): its image, built without a
// container engine, installed by the Helm chart on a second cluster whose
// node runs containerd and runc, and a GPU pod's container printing what it
// got.
//
//	make demo                       # from the repository root
//	go run ./test/cmd/demo --keep   # keep the cluster dir (logs) afterwards
//
// In the first part the plugin runs in this process, one instance per
// node, through driver/plugin.Start: the same code the tessera-kubelet-plugin
// binary runs, with each node's directories and its own service account
// token. Component logs go to <dir>/logs; the plugins' log is
// <dir>/logs/tessera-kubelet-plugins.log. The chart part's logs, the plugin
// pod's among them, are under <dir>/chart-cluster.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"k8s.io/klog/v2"
	"k8s.io/klog/v2/textlogger"

	"github.com/tessera-dev/tessera/test/cluster"
)

func main() {
	var o options
	flag.StringVar(&o.dir, "dir", "", "cluster directory (default: a new one under $TMPDIR, removed after a successful run)")
	flag.StringVar(&o.examples, "examples", "deployments/examples", "directory of the example manifests")
	flag.BoolVar(&o.keep, "keep", false, "keep the cluster directory (logs, CDI specs) after the demo")
	flag.DurationVar(&o.timeout, "timeout", 10*time.Minute, "give up after this long (the first run builds Tessera's image)")
	flag.Parse()
	start := time.Now()
	err := run(o)
	if err != nil {
		fmt.Fprintf(os.Stderr, "\nFAIL: demo: %v\n", err)
		os.Exit(1)
	}
	fmt.Printf("\ndemo passed in %v\n", time.Since(start).Round(time.Second))
}

type options struct {
	dir      string
	examples string
	keep     bool
	timeout  time.Duration
}

func run(o options) (err error) {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()

	if err := cluster.CheckPrerequisites(); err != nil {
		return fmt.Errorf("this machine cannot run the local cluster:\n%w", err)
	}
	created := o.dir == ""
	if created {
		if o.dir, err = os.MkdirTemp("", "tessera-demo-"); err != nil {
			return fmt.Errorf("create cluster dir: %w", err)
		}
	}
	// A failed run keeps its dir for its logs; an interrupted one does not.
	defer func() {
		interrupted := errors.Is(context.Cause(ctx), context.Canceled)
		if created && !o.keep && (err == nil || interrupted) {
			_ = os.RemoveAll(o.dir)
			return
		}
		fmt.Printf("cluster dir kept: %s (component logs in %s)\n", o.dir, filepath.Join(o.dir, "logs"))
	}()
	logFile, err := openLog(o.dir)
	if err != nil {
		return err
	}
	defer func() { _ = logFile.Close() }()
	logger := textlogger.NewLogger(textlogger.NewConfig(textlogger.Output(logFile)))
	klog.SetLogger(logger)
	ctx = klog.NewContext(ctx, logger)

	d := &demo{examples: o.examples}
	defer d.teardown()
	err = d.setUp(ctx, o.dir)
	if err == nil {
		err = d.runWorkloads(ctx)
	}
	if err == nil {
		err = d.cleanUp(ctx)
	}
	d.teardown()
	if err == nil {
		err = runChart(ctx, o.dir)
	}
	if cause := context.Cause(ctx); err != nil && cause != nil {
		if errors.Is(cause, context.Canceled) {
			return fmt.Errorf("interrupted: %w", err)
		}
		return fmt.Errorf("timed out after %v: %w", o.timeout, err)
	}
	return err
}

func openLog(dir string) (*os.File, error) {
	logs := filepath.Join(dir, "logs")
	if err := os.MkdirAll(logs, 0o700); err != nil {
		return nil, fmt.Errorf("create log dir: %w", err)
	}
	f, err := os.OpenFile(filepath.Join(logs, "tessera-kubelet-plugins.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open plugin log: %w", err)
	}
	return f, nil
}
