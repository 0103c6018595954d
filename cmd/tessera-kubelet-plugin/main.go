// Command tessera-kubelet-plugin is Tessera's node agent (a DaemonSet): it
// publishes the node's GPUs as ResourceSlices and prepares claims for the
// kubelet. It only parses flags and runs package plugin.
package main

import (
	"context"
	"fmt"

	"k8s.io/klog/v2"

	"github.com/tessera-dev/tessera/component"
	"github.com/tessera-dev/tessera/driver/plugin"
)

func main() {
	var o plugin.Options
	component.Main("tessera-kubelet-plugin", &o, func(ctx context.Context) error { return run(ctx, o) })
}

func run(ctx context.Context, o plugin.Options) error {
	client, err := plugin.NewClient(o)
	if err != nil {
		return err
	}
	p, err := plugin.Start(ctx, o, client)
	if err != nil {
		return err
	}
	// The plugin's context derives from ctx, so a signal closes both: only
	// a plugin that stopped while ctx lives failed.
	select {
	case <-ctx.Done():
	case <-p.Done():
	}
	if ctx.Err() != nil {
		klog.FromContext(ctx).Info("Shutting down", "cause", context.Cause(ctx))
		p.Stop()
		return nil
	}
	p.Stop()
	return fmt.Errorf("stopped: %w", p.Err())
}
