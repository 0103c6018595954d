// Package component runs a Tessera binary the way every Kubernetes component
// runs: flags (pflag, with klog's flags), validation, a context that ends on
// SIGTERM or SIGINT and carries the logger, and an error printed with the
// binary's name and exit status 1. Every cmd/ uses it, so the binaries start
// and stop alike.
package component

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/pflag"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"
)

// Options are a binary's settings.
type Options interface {
	AddFlags(fs *pflag.FlagSet)
	Validate() error
}

// Main parses os.Args into o, validates it and calls run with a context that
// ends on SIGTERM or SIGINT; it exits 1 with the error if run fails.
func Main(name string, o Options, run func(ctx context.Context) error) {
	if err := Run(name, os.Args[1:], o, run); err != nil {
		fmt.Fprintln(os.Stderr, name+":", err)
		os.Exit(1)
	}
}

// Run is Main without the exit: it parses args into o, validates it and
// calls run.
func Run(name string, args []string, o Options, run func(ctx context.Context) error) error {
	fs := pflag.NewFlagSet(name, pflag.ContinueOnError)
	o.AddFlags(fs)
	klogFlags := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(klogFlags)
	fs.AddGoFlagSet(klogFlags)
	if err := fs.Parse(args); err != nil {
		return err
	}
	if err := o.Validate(); err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	return run(klog.NewContext(ctx, klog.Background()))
}

// RESTConfig is the API client configuration of a component: the
// kubeconfig's, or the pod's service account when kubeconfig is empty, with
// deliberate rate limits (client-go's default of 5 qps turns bursts of
// calls into 200 ms waits) and a deadline for every request: timeout, which
// each component chooses next to its call (see Deadline).
func RESTConfig(kubeconfig string, qps float32, burst int, userAgent string, timeout time.Duration) (*rest.Config, error) {
	var cfg *rest.Config
	var err error
	if kubeconfig != "" {
		cfg, err = clientcmd.BuildConfigFromFlags("", kubeconfig)
	} else {
		cfg, err = rest.InClusterConfig()
	}
	if err != nil {
		return nil, fmt.Errorf("load API client configuration (set --kubeconfig outside a cluster): %w", err)
	}
	cfg.QPS, cfg.Burst = qps, burst
	cfg.UserAgent = userAgent
	if timeout <= 0 {
		return nil, fmt.Errorf("API request timeout %v: want a positive duration", timeout)
	}
	cfg.Wrap(Deadline(timeout))
	return cfg, nil
}

// Wait blocks until ctx ends (a signal: nil) or the component's own work
// stops (done closes: err's error). The work's context usually derives from
// ctx, so a signal closes both; only work that stopped while ctx lives
// failed.
func Wait(ctx context.Context, done <-chan struct{}, err func() error) error {
	select {
	case <-ctx.Done():
	case <-done:
	}
	if ctx.Err() != nil {
		klog.FromContext(ctx).Info("Shutting down", "cause", context.Cause(ctx))
		return nil
	}
	return fmt.Errorf("stopped: %w", err())
}
