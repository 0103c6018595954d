// Package webhook embeds the admission webhook's configuration, so that tests
// install exactly what operators install.
package webhook

import _ "embed"

// Configuration is the ValidatingWebhookConfiguration that sends
// ResourceClaims, ResourceClaimTemplates and DeviceClasses with Tessera
// configurations to the tessera-webhook Service.
//
//go:embed webhook.yaml
var Configuration []byte

// Namespace and Service the webhook runs behind.
const (
	Namespace = "tessera-system"
	Service   = "tessera-webhook"
)
