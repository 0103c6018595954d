// Command tessera-webhook is Tessera's validating admission webhook (a
// Deployment): the API server sends it ResourceClaims, ResourceClaimTemplates
// and DeviceClasses, and it refuses malformed gpu.tessera.dev device
// configurations. It only parses flags and runs package webhook.
package main

import (
	"context"
	"fmt"

	"k8s.io/klog/v2"

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
	if o.MetricsAddress != "" {
		ms, err := metricsserver.Start(ctx, "--metrics-address", o.MetricsAddress, reg, srv.Err)
		if err != nil {
			return err
		}
		defer ms.Stop()
	}
	// A signal may close both: only a server that stopped while ctx lives
	// failed.
	select {
	case <-ctx.Done():
	case <-srv.Done():
	}
	if ctx.Err() != nil {
		klog.FromContext(ctx).Info("Shutting down", "cause", context.Cause(ctx))
		return nil
	}
	return fmt.Errorf("stopped: %w", srv.Err())
}
