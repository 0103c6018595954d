package helm

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"helm.sh/helm/v4/pkg/chart/v2/lint"
	"helm.sh/helm/v4/pkg/chart/v2/lint/support"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/yaml"

	"github.com/tessera-dev/tessera/driver/fakenode"
)

// strictDecoder decodes every Kubernetes type and CRDs, refusing unknown and
// duplicate fields.
var strictDecoder = func() runtime.Decoder {
	s := runtime.NewScheme()
	if err := scheme.AddToScheme(s); err != nil {
		panic(err)
	}
	if err := apiextensionsv1.AddToScheme(s); err != nil {
		panic(err)
	}
	return serializer.NewCodecFactory(s, serializer.EnableStrict).UniversalDeserializer()
}()

// rendered is one combination's objects, typed where Kubernetes knows the
// type; cert-manager's are kept apart.
type rendered struct {
	objects     []runtime.Object
	certManager []*unstructured.Unstructured
}

// renderT renders a combination and strictly decodes every object.
func renderT(t *testing.T, c Combination) rendered {
	t.Helper()
	manifests, err := Render(context.Background(), c.Values, c.Release)
	if err != nil {
		t.Fatalf("%s: %v", c.Name, err)
	}
	var out rendered
	seen := map[string]string{}
	for _, m := range manifests {
		var u unstructured.Unstructured
		if err := yaml.Unmarshal([]byte(m.YAML), &u.Object); err != nil {
			t.Fatalf("%s: %s: not YAML: %v", c.Name, m.Source, err)
		}
		id := fmt.Sprintf("%s %s/%s", u.GetKind(), u.GetNamespace(), u.GetName())
		if prev, dup := seen[id]; dup {
			t.Errorf("%s: %s rendered twice (%s and %s)", c.Name, id, prev, m.Source)
		}
		seen[id] = m.Source
		if u.GroupVersionKind().Group == "cert-manager.io" {
			out.certManager = append(out.certManager, &u)
			continue
		}
		obj, _, err := strictDecoder.Decode([]byte(m.YAML), nil, nil)
		if err != nil {
			t.Errorf("%s: %s (%s): %v", c.Name, m.Source, id, err)
			continue
		}
		if ns := u.GetNamespace(); ns != "" && ns != c.Release.Namespace {
			t.Errorf("%s: %s is in namespace %q, not the release's %q", c.Name, id, ns, c.Release.Namespace)
		}
		out.objects = append(out.objects, obj)
	}
	return out
}

// find returns the rendered objects of type T.
func find[T runtime.Object](r rendered) []T {
	var out []T
	for _, o := range r.objects {
		if v, ok := o.(T); ok {
			out = append(out, v)
		}
	}
	return out
}

// TestChartLints runs Helm's own linter (chart file, values against the
// schema, templates, CRDs) for every values combination, for Kubernetes
// KubeVersion. Warnings fail like errors.
func TestChartLints(t *testing.T) {
	kv, err := Capabilities()
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range Combinations() {
		start := time.Now()
		result := lint.RunAll(ChartDir, c.Values, c.Release.Namespace, lint.WithKubeVersion(&kv.KubeVersion))
		for _, m := range result.Messages {
			if m.Severity >= support.WarningSev {
				t.Errorf("%s: %s", c.Name, m)
			} else {
				t.Logf("%s: %s", c.Name, m)
			}
		}
		t.Logf("%s: linted in %v", c.Name, time.Since(start).Round(time.Millisecond))
	}
}

// TestChartRendersValidObjects renders every combination and decodes every
// object strictly into its Kubernetes type: no unknown or misspelt field,
// no object twice, every namespaced object in the release namespace, and
// cert-manager objects only where cert-manager was asked for.
func TestChartRendersValidObjects(t *testing.T) {
	for _, c := range Combinations() {
		start := time.Now()
		r := renderT(t, c)
		elapsed := time.Since(start)
		var kinds []string
		for _, u := range r.certManager {
			kinds = append(kinds, u.GetKind())
		}
		wantCM := []string(nil)
		if webhookValues(c.Values)["certManager"] != nil {
			wantCM = []string{"Certificate", "Issuer"}
		}
		if slices.Sort(kinds); !slices.Equal(kinds, wantCM) {
			t.Errorf("%s: cert-manager objects %v, want %v", c.Name, kinds, wantCM)
		}
		t.Logf("%s: %d objects rendered and decoded in %v", c.Name, len(r.objects)+len(r.certManager), elapsed.Round(time.Millisecond))
	}
}

// webhookValues returns a combination's webhook values, nil when it has none.
func webhookValues(values map[string]any) map[string]any {
	w, _ := values["webhook"].(map[string]any)
	return w
}

// TestValuesAreChecked: a misspelt value, a webhook without TLS and an
// unknown fake node fail the render with a message naming them, instead of
// rendering a chart that silently ignores them.
func TestValuesAreChecked(t *testing.T) {
	for _, tc := range []struct {
		name   string
		values map[string]any
		want   string
	}{
		{"misspelt", map[string]any{"kubeletPlugin": map[string]any{"timeSliceGPUs": "all=4"}}, "timeSliceGPUs"},
		{"webhook-without-tls", map[string]any{"webhook": map[string]any{"enabled": true}}, "webhook.enabled needs TLS"},
		{"unknown-fake-node", map[string]any{"kubeletPlugin": map[string]any{"fakeNode": "dgx-z9"}}, "fakeNode"},
		{"relative-driver-root", map[string]any{"kubeletPlugin": map[string]any{"driverRoot": "run/nvidia"}}, "driverRoot"},
	} {
		_, err := Render(context.Background(), tc.values, DefaultRelease)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: render error %v, want one naming %q", tc.name, err, tc.want)
		}
	}
}

// TestFakeNodeValuesAreTheProfiles: the schema offers exactly the fake-node
// profiles the plugin knows (driver/fakenode), and "" for real NVML.
func TestFakeNodeValuesAreTheProfiles(t *testing.T) {
	data, err := os.ReadFile(filepath.Join(ChartDir, "values.schema.json"))
	if err != nil {
		t.Fatal(err)
	}
	var schema struct {
		Properties struct {
			KubeletPlugin struct {
				Properties struct {
					FakeNode struct {
						Enum []string `json:"enum"`
					} `json:"fakeNode"`
				} `json:"properties"`
			} `json:"kubeletPlugin"`
		} `json:"properties"`
	}
	if err := json.Unmarshal(data, &schema); err != nil {
		t.Fatal(err)
	}
	want := append([]string{""}, fakenode.Profiles()...)
	got := slices.Sorted(slices.Values(schema.Properties.KubeletPlugin.Properties.FakeNode.Enum))
	if !slices.Equal(got, want) {
		t.Errorf("values.schema.json kubeletPlugin.fakeNode enum %q, want %q (driver/fakenode profiles)", got, want)
	}
}
