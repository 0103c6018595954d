// Command tessera-webhook is Tessera's validating admission webhook (a
// Deployment): the API server sends it ResourceClaims, ResourceClaimTemplates
// and DeviceClasses, and it refuses malformed gpu.tessera.dev device
// configurations. It only parses flags and runs package webhook.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/pflag"
	"k8s.io/klog/v2"

	"github.com/tessera-dev/tessera/metricsserver"
	"github.com/tessera-dev/tessera/webhook"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "tessera-webhook:", err)
		os.Exit(1)
	}
}

func run() error {
	var o webhook.Options
	fs := pflag.NewFlagSet("tessera-webhook", pflag.ContinueOnError)
	o.AddFlags(fs)
	klogFlags := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(klogFlags)
	fs.AddGoFlagSet(klogFlags)
	if err := fs.Parse(os.Args[1:]); err != nil {
		return err
	}
	if err := o.Validate(); err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	ctx = klog.NewContext(ctx, klog.Background())

	reg := metricsserver.NewRegistry()
	srv, err := webhook.Start(ctx, o, reg)
	if err != nil {
		return err
	}
	defer srv.Stop()
	if o.MetricsAddress != "" {
		ms, err := metricsserver.Start(ctx, "--metrics-address", o.MetricsAddress, reg, srv.Err)
		if err != nil {
			return err
		}
		defer ms.Stop()
	}
	select {
	case <-ctx.Done():
		klog.FromContext(ctx).Info("Shutting down", "cause", context.Cause(ctx))
		return nil
	case <-srv.Done():
		return fmt.Errorf("stopped: %w", srv.Err())
	}
}
