package webhook

import (
	"encoding/json"
	"fmt"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/validation/field"
)

// opaqueConfig is one opaque device configuration and where its parameters
// sit in the object.
type opaqueConfig struct {
	path   *field.Path // ....opaque.parameters
	driver string
	raw    []byte
}

// object is what the webhook reads from a reviewed object: its name and its
// opaque configurations.
type object struct {
	name    string
	configs []opaqueConfig
}

// readers decode each reviewed kind. Requests for resource.k8s.io's older
// versions arrive converted to v1 (the webhook configuration's default
// matchPolicy Equivalent), so v1 is all there is to read.
var readers = map[schema.GroupVersionKind]func(raw []byte) (object, error){
	resourceapi.SchemeGroupVersion.WithKind("ResourceClaim"):         readClaim,
	resourceapi.SchemeGroupVersion.WithKind("ResourceClaimTemplate"): readClaimTemplate,
	resourceapi.SchemeGroupVersion.WithKind("DeviceClass"):           readDeviceClass,
}

func readClaim(raw []byte) (object, error) {
	var o resourceapi.ResourceClaim
	if err := json.Unmarshal(raw, &o); err != nil {
		return object{}, fmt.Errorf("decode ResourceClaim: %w", err)
	}
	return object{o.Name, claimConfigs(o.Spec.Devices.Config, field.NewPath("spec", "devices", "config"))}, nil
}

func readClaimTemplate(raw []byte) (object, error) {
	var o resourceapi.ResourceClaimTemplate
	if err := json.Unmarshal(raw, &o); err != nil {
		return object{}, fmt.Errorf("decode ResourceClaimTemplate: %w", err)
	}
	return object{o.Name, claimConfigs(o.Spec.Spec.Devices.Config, field.NewPath("spec", "spec", "devices", "config"))}, nil
}

func readDeviceClass(raw []byte) (object, error) {
	var o resourceapi.DeviceClass
	if err := json.Unmarshal(raw, &o); err != nil {
		return object{}, fmt.Errorf("decode DeviceClass: %w", err)
	}
	var out []opaqueConfig
	for i, c := range o.Spec.Config {
		out = appendOpaque(out, c.DeviceConfiguration, field.NewPath("spec", "config").Index(i))
	}
	return object{o.Name, out}, nil
}

func claimConfigs(configs []resourceapi.DeviceClaimConfiguration, path *field.Path) []opaqueConfig {
	var out []opaqueConfig
	for i, c := range configs {
		out = appendOpaque(out, c.DeviceConfiguration, path.Index(i))
	}
	return out
}

func appendOpaque(out []opaqueConfig, c resourceapi.DeviceConfiguration, path *field.Path) []opaqueConfig {
	if c.Opaque == nil {
		return out
	}
	return append(out, opaqueConfig{
		path:   path.Child("opaque", "parameters"),
		driver: c.Opaque.Driver,
		raw:    c.Opaque.Parameters.Raw,
	})
}
