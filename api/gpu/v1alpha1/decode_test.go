package v1alpha1

import (
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/util/validation/field"
)

func TestDecode(t *testing.T) {
	for _, tc := range []struct {
		name, json string
		// wantErr lists fragments the error must contain; empty means valid.
		wantErr []string
	}{
		{"gpu exclusive", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"Exclusive"}}`, nil},
		{"gpu time-slicing", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"TimeSlicing","timeSlicingConfig":{"interval":"Default"}}}`, nil},
		{"interval NVML cannot set", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"TimeSlicing","timeSlicingConfig":{"interval":"Long"}}}`, []string{"sharing.timeSlicingConfig.interval", "NVML", "use Default"}},
		{"gpu mps", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","mpsConfig":{"defaultActiveThreadPercentage":50,"defaultPinnedDeviceMemoryLimit":"10Gi","defaultPerDevicePinnedMemoryLimit":{"0":"5Gi"}}}}`, nil},
		{"power", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","powerLimitWatts":350}`, nil},
		{"mig mps", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"MigDeviceConfig","sharing":{"strategy":"MPS"}}`, nil},
		{"unknown field", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharng":{}}`, []string{`unknown field "sharng"`}},
		{"nested unknown field", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","mpsConfg":{}}}`, []string{"parameters.sharing.mpsConfg", `unknown field "mpsConfg"`}},
		{"names are case-sensitive", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","Sharing":{"strategy":"MPS"}}`, []string{`unknown field "Sharing"`, "case-sensitive"}},
		{"duplicate field", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","powerLimitWatts":300,"powerLimitWatts":400}`, []string{"parameters.powerLimitWatts", `duplicate field "powerLimitWatts"`}},
		{"nested wrong type", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","mpsConfig":{"defaultActiveThreadPercentage":"half"}}}`, []string{"parameters.sharing.mpsConfig.defaultActiveThreadPercentage", "got JSON string, want int32"}},
		{"bad quantity", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","mpsConfig":{"defaultPinnedDeviceMemoryLimit":"lots"}}}`, []string{"cannot decode as GpuConfig", "quantities must match"}},
		{"wrong type", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","powerLimitWatts":"high"}`, []string{"powerLimitWatts", "string"}},
		{"bad strategy", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"Shared"}}`, []string{"sharing.strategy", `"Exclusive"`, `"TimeSlicing"`, `"MPS"`}},
		{"time-slicing on MIG", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"MigDeviceConfig","sharing":{"strategy":"TimeSlicing"}}`, []string{"sharing.strategy", `"MPS"`}},
		{"bad interval", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"TimeSlicing","timeSlicingConfig":{"interval":"Forever"}}}`, []string{"sharing.timeSlicingConfig.interval", `"Short"`}},
		{"mps settings without mps", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"Exclusive","mpsConfig":{}}}`, []string{"sharing.mpsConfig", "only with strategy MPS"}},
		{"thread percentage", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","mpsConfig":{"defaultActiveThreadPercentage":0}}}`, []string{"defaultActiveThreadPercentage", "between 1 and 100"}},
		{"memory limit", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","mpsConfig":{"defaultPinnedDeviceMemoryLimit":"-1Gi"}}}`, []string{"defaultPinnedDeviceMemoryLimit", "positive"}},
		{"per-device key", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","mpsConfig":{"defaultPerDevicePinnedMemoryLimit":{"gpu0":"1Gi"}}}}`, []string{`defaultPerDevicePinnedMemoryLimit[gpu0]`, "device indexes"}},
		{"power out of range", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","powerLimitWatts":0}`, []string{"powerLimitWatts", "between 1 and 5000"}},
		{"wrong version", `{"apiVersion":"gpu.tessera.dev/v1","kind":"GpuConfig"}`, []string{"apiVersion", "gpu.tessera.dev/v1alpha1"}},
		{"unknown kind", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"TpuConfig"}`, []string{"kind", "GpuConfig", "MigDeviceConfig"}},
		{"not an object", `[1,2]`, []string{"not a JSON object"}},
		{"trailing data", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig"} {}`, []string{"not a JSON object", "after top-level value"}},
		{"too large", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","x":"` + strings.Repeat("a", MaxConfigBytes) + `"}`, []string{"bytes", "10240"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := Decode([]byte(tc.json))
			if len(tc.wantErr) == 0 {
				if err != nil || cfg == nil {
					t.Fatalf("got %v", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("accepted: %+v", cfg)
			}
			for _, frag := range tc.wantErr {
				if !strings.Contains(err.Error(), frag) {
					t.Errorf("error %q lacks %q", err, frag)
				}
			}
		})
	}
}

// TestDecodeAtNamesTheFullField: errors carry the caller's path to the
// configuration, so a webhook's message names the field in the user's object.
func TestDecodeAtNamesTheFullField(t *testing.T) {
	root := field.NewPath("spec", "devices", "config").Index(1).Child("opaque", "parameters")
	for _, tc := range []struct{ name, json, want string }{
		{"value", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","mpsConfig":{"defaultActiveThreadPercentage":150}}}`,
			"spec.devices.config[1].opaque.parameters.sharing.mpsConfig.defaultActiveThreadPercentage: Invalid value: 150: must be between 1 and 100"},
		{"unknown field", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"MigDeviceConfig","sharing":{"strategy":"MPS","mpsConfig":{"x":1}}}`,
			`spec.devices.config[1].opaque.parameters.sharing.mpsConfig.x: Forbidden: unknown field "x"`},
		{"type", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","powerLimitWatts":true}`,
			"spec.devices.config[1].opaque.parameters.powerLimitWatts: Invalid value: got JSON bool, want int32"},
		{"kind", `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"TpuConfig"}`,
			`spec.devices.config[1].opaque.parameters.kind: Unsupported value: "TpuConfig": supported values: "GpuConfig", "MigDeviceConfig"`},
		{"not an object", `"MPS"`, "spec.devices.config[1].opaque.parameters: Invalid value: configuration is not a JSON object"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, errs := DecodeAt([]byte(tc.json), root)
			if len(errs) != 1 {
				t.Fatalf("got config %+v and %d errors %v, want one error", cfg, len(errs), errs)
			}
			if got := errs[0].Error(); !strings.HasPrefix(got, tc.want) {
				t.Errorf("error\n  %s\nwant it to start with\n  %s", got, tc.want)
			}
		})
	}
}

func TestMergeLaterConfigsWinFieldByField(t *testing.T) {
	decode := func(s string) Config {
		c, err := Decode([]byte(s))
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	class := decode(`{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"TimeSlicing"},"powerLimitWatts":300}`)
	claim := decode(`{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS"}}`)
	mig := decode(`{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"MigDeviceConfig","sharing":{"strategy":"MPS"}}`)
	gpu, m := Merge(class, claim, mig)
	if gpu.Sharing.Strategy != MPS || gpu.PowerLimitWatts == nil || *gpu.PowerLimitWatts != 300 {
		t.Errorf("merged GPU config %+v", gpu)
	}
	if m == nil || m.Sharing.Strategy != MPS {
		t.Errorf("merged MIG config %+v", m)
	}
	if g, _ := Merge(mig); g != nil {
		t.Errorf("a MIG config produced a GPU config %+v", g)
	}
}

// FuzzDecode: no input panics, and every error names what is wrong.
func FuzzDecode(f *testing.F) {
	f.Add([]byte(`{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","mpsConfig":{"defaultActiveThreadPercentage":50}}}`))
	f.Add([]byte(`{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"MigDeviceConfig"}`))
	f.Add([]byte(`{}`))
	f.Fuzz(func(t *testing.T, raw []byte) {
		cfg, err := Decode(raw)
		if err != nil {
			if len(err.Error()) < 10 {
				t.Fatalf("uninformative error %q", err)
			}
			return
		}
		if errs := Validate(cfg); len(errs) > 0 {
			t.Fatalf("decoded config does not validate: %v", errs)
		}
	})
}
