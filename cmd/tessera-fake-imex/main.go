// Command tessera-fake-imex is the simulated driver's nvidia-imex (package
// driver/fakenode/imexd): a fake node's usr/bin/nvidia-imex links to it, and
// the plugin's IMEX daemon pods, from Tessera's image, run it.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/tessera-dev/tessera/driver/fakenode/imexd"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := imexd.Run(ctx, os.Args[1:], os.Stdout, nil); err != nil {
		fmt.Fprintln(os.Stderr, "nvidia-imex (Tessera's stand-in):", err)
		stop()
		os.Exit(1)
	}
}
