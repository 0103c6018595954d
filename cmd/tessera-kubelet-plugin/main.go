// Command tessera-kubelet-plugin is Tessera's node agent (a DaemonSet): it
// publishes the node's GPUs as ResourceSlices and prepares claims for the
// kubelet. It only parses flags and runs package plugin.
package main

import (
	"context"

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
	err = component.Wait(ctx, p.Done(), p.Err)
	p.Stop()
	return err
}
