package helm

import (
	"context"
	"os"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// manifestsFile is the committed plain-manifests file, relative to this
// package.
const manifestsFile = "../manifests/tessera.yaml"

// TestPlainManifestsAreUpToDate: deployments/manifests/tessera.yaml is
// exactly what the chart renders now. Run `make manifests` after changing
// the chart.
func TestPlainManifestsAreUpToDate(t *testing.T) {
	want, err := PlainManifests(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(manifestsFile)
	if err != nil {
		t.Fatalf("%v; run `make manifests`", err)
	}
	if diff := cmp.Diff(string(want), string(got)); diff != "" {
		t.Errorf("deployments/manifests/tessera.yaml is stale; run `make manifests` (-rendered +committed):\n%s", diff)
	}
}
