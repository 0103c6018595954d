// Package crds embeds Tessera's CustomResourceDefinitions, so that tests
// install exactly what operators install.
package crds

import _ "embed"

// Gang is the CRD of gangs (api/gang/v1alpha1).
//
//go:embed gang.tessera.dev_gangs.yaml
var Gang []byte
