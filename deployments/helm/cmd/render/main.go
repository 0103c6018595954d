// Command render writes the plain manifests, deployments/manifests/tessera.yaml:
// the Helm chart rendered with Helm's own Go code (package helm) for the
// release tessera in tessera-system, with the values helm.ManifestValues.
// Run it through `make manifests`.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"

	"github.com/tessera-dev/tessera/deployments/helm"
)

func main() {
	out := flag.String("o", "deployments/manifests/tessera.yaml", "File to write; - for standard output.")
	flag.Parse()
	data, err := helm.PlainManifests(context.Background())
	if err == nil {
		if *out == "-" {
			_, err = os.Stdout.Write(data)
		} else {
			err = os.WriteFile(*out, data, 0o644)
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "render:", err)
		os.Exit(1)
	}
}
