// Command tessera-webhook is Tessera's validating admission webhook (a
// Deployment): the API server sends it ResourceClaims, ResourceClaimTemplates
// and DeviceClasses, and it refuses malformed gpu.tessera.dev device
// configurations. It only parses flags and runs package webhook.
package main

import (
	"context"

	"github.com/tessera-dev/tessera/component"
	"github.com/tessera-dev/tessera/metricsserver"
	"github.com/tessera-dev/tessera/webhook"
)

func main() {
	var o webhook.Options
	component.Main("tessera-webhook", &o, func(ctx context.Context) error { return run(ctx, o) })
}

func run(ctx context.Context, o webhook.Options) error {

	reg := metricsserver.NewRegistry()
	srv, err := webhook.Start(ctx, o, reg)
	if err != nil {
		return err
	}
	defer srv.Stop()
	ms, err := metricsserver.Start(ctx, o.Addresses, reg, srv.Err)
	if err != nil {
		return err
	}
	defer ms.Stop()
	return component.Wait(ctx, srv.Done(), srv.Err)
}
