// Command tessera-cdi-hook runs as a createContainer hook of Tessera's CDI
// specs (update-ldcache, package driver/cdihook), and installs itself onto
// the host for them (install).
package main

import (
	"fmt"
	"os"

	"github.com/tessera-dev/tessera/driver/cdihook"
)

func main() {
	if err := cdihook.Main(os.Args[1:], os.Stdin); err != nil {
		fmt.Fprintln(os.Stderr, "tessera-cdi-hook:", err)
		os.Exit(1)
	}
}
