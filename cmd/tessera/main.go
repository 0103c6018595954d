// Command tessera is the operator's tool: `tessera inspect` prints the
// ResourceSlices a node would publish, from real NVML or a simulated node;
// `tessera explain` says why a claim is pending. Installed as
// kubectl-tessera it is also a kubectl plugin: `kubectl tessera ...`.
package main

import (
	"os"

	"github.com/tessera-dev/tessera/driver/cli"
)

func main() {
	if err := cli.NewCommand(cli.Name(os.Args[0])).Execute(); err != nil {
		os.Exit(1)
	}
}
