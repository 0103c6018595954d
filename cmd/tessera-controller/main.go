// Command tessera-controller is Tessera's gang controller (a Deployment with
// leader election): it publishes the multi-node gang domains and places
// gangs all or nothing. It only parses flags and runs package controller.
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

	"github.com/tessera-dev/tessera/controller"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "tessera-controller:", err)
		os.Exit(1)
	}
}

func run() error {
	var o controller.Options
	fs := pflag.NewFlagSet("tessera-controller", pflag.ContinueOnError)
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
	return controller.Run(ctx, o)
}
