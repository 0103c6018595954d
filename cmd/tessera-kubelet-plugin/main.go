// Command tessera-kubelet-plugin is Tessera's node agent (a DaemonSet): it
// publishes the node's GPUs as ResourceSlices and prepares claims for the
// kubelet. It only parses flags and runs package plugin.
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

	"github.com/tessera-dev/tessera/driver/plugin"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "tessera-kubelet-plugin:", err)
		os.Exit(1)
	}
}

func run() error {
	var o plugin.Options
	fs := pflag.NewFlagSet("tessera-kubelet-plugin", pflag.ContinueOnError)
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
	client, err := plugin.NewClient(o)
	if err != nil {
		return err
	}
	p, err := plugin.Start(ctx, o, client)
	if err != nil {
		return err
	}
	select {
	case <-ctx.Done():
		klog.FromContext(ctx).Info("Shutting down", "cause", context.Cause(ctx))
		p.Stop()
		return nil
	case <-p.Done():
		p.Stop()
		return fmt.Errorf("stopped: %w", p.Err())
	}
}
