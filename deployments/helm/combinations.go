package helm

// Combination is one set of values the chart is linted, rendered and applied
// to a real API server with (deployments/helm tests, test/e2e/helm_test.go).
type Combination struct {
	Name    string
	Release Release
	Values  map[string]any
}

// ManifestValues are the values deployments/manifests/tessera.yaml is
// rendered with: the defaults, plus the namespace, which Helm users create
// with --create-namespace and people without Helm get from the file.
func ManifestValues() map[string]any {
	return map[string]any{"namespace": map[string]any{"create": true}}
}

// testCABundle stands in for a CA's base64 PEM: the API server stores
// caBundle as given, and nothing here calls the webhook.
const testCABundle = "LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCk1JSUJ0ZXN0Ci0tLS0tRU5EIENFUlRJRklDQVRFLS0tLS0K"

// Combinations are the values combinations CI checks: the defaults, the
// plain manifests' values, the webhook with each kind of TLS, thirteen
// kubelet-plugin settings changed at once (without the controller), and a
// controller keyed on another topology label. Each has its own release and
// namespace, so they can be applied one after another.
func Combinations() []Combination {
	return []Combination{
		{Name: "defaults", Release: DefaultRelease, Values: map[string]any{}},
		{Name: "manifests", Release: Release{Name: "tessera", Namespace: "tessera-manifests"}, Values: ManifestValues()},
		{Name: "webhook-cert-manager", Release: Release{Name: "gpu", Namespace: "gpu-drivers"}, Values: map[string]any{
			"webhook": map[string]any{"enabled": true, "certManager": map[string]any{"enabled": true}},
		}},
		{Name: "webhook-secret", Release: Release{Name: "tessera", Namespace: "tessera-tls"}, Values: map[string]any{
			"namespace": map[string]any{"create": true},
			"webhook": map[string]any{"enabled": true, "replicas": 2, "metricsBindAddress": "::",
				"tls": map[string]any{"secretName": "my-webhook-cert", "caBundle": testCABundle}},
		}},
		{Name: "sharing-fake-node-no-controller", Release: Release{Name: "demo", Namespace: "tessera-demo"}, Values: map[string]any{
			"image":        map[string]any{"repository": "registry.example/tessera", "tag": "v9.9.9", "pullPolicy": "Always"},
			"featureGates": map[string]any{"DynamicMIG": false, "DeviceHealth": true},
			"kubeletPlugin": map[string]any{
				"driverRoot":       "/run/nvidia/driver",
				"runtimeClassName": "nvidia",
				"timeSlicedGPUs":   "all=4",
				"memorySharedGPUs": "0,1",
				"mpsImage":         "registry.example/mps:1",
				"fakeNode":         "dgx-h100",
				"extraArgs":        []any{"--health-probe-interval=30s"},
				"extraEnv":         []any{map[string]any{"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"}},
				"kubeletDir":       "/var/lib/k0s/kubelet",
				"cdiRoot":          "/etc/cdi",
				"hostNetwork":      true,
				"nodeSelector":     map[string]any{"example.com/gpu": "yes"},
				"resources":        map[string]any{"requests": map[string]any{"cpu": "100m", "memory": "128Mi"}},
			},
			"controller": map[string]any{"enabled": false},
		}},
		{Name: "controller-topology", Release: Release{Name: "tessera", Namespace: "tessera-topology"}, Values: map[string]any{
			// The GPU operator's driver container.
			"kubeletPlugin": map[string]any{"driverRoot": "/run/nvidia/driver"},
			"controller": map[string]any{"replicas": 2, "topologyKey": "topology.kubernetes.io/rack", "domainChannels": 4,
				"extraArgs": []any{"--leader-elect-lease-duration=20s"}, "metricsBindAddress": "0.0.0.0"},
		}},
	}
}
