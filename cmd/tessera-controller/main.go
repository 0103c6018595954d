// Command tessera-controller is Tessera's gang controller (a Deployment with
// leader election): it publishes the multi-node gang domains and places
// gangs all or nothing. It only parses flags and runs package controller.
package main

import (
	"context"

	"github.com/tessera-dev/tessera/component"
	"github.com/tessera-dev/tessera/controller"
)

func main() {
	var o controller.Options
	component.Main("tessera-controller", &o, func(ctx context.Context) error { return controller.Run(ctx, o) })
}
