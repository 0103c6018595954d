// Command tessera is the operator's tool: `tessera inspect` prints the
// ResourceSlices a node would publish, from real NVML or a simulated node.
package main

import (
	"os"

	"github.com/tessera-dev/tessera/driver/cli"
)

func main() {
	if err := cli.NewCommand().Execute(); err != nil {
		os.Exit(1)
	}
}
