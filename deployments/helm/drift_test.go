package helm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"

	"github.com/tessera-dev/tessera/deployments/crds"
	"github.com/tessera-dev/tessera/deployments/rbac"
	webhookconfig "github.com/tessera-dev/tessera/deployments/webhook"
	"github.com/tessera-dev/tessera/deviceclass"
)

// sharedKinds are the kinds whose every object exists twice: in the chart
// and in the embedded manifests the tests install. A chart object of these
// kinds without an embedded twin is drift too.
var sharedKinds = []string{
	"CustomResourceDefinition", "DeviceClass", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
	"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "ValidatingWebhookConfiguration",
}

// embeddedManifests are the YAML files tests install, by file.
func embeddedManifests(t *testing.T) map[string][]byte {
	t.Helper()
	files := map[string][]byte{
		"deployments/rbac/kubelet-plugin.yaml":         rbac.KubeletPlugin,
		"deployments/rbac/node-lock.yaml":              rbac.NodeLock,
		"deployments/rbac/mps-lock.yaml":               rbac.MPSLock,
		"deployments/rbac/imex-lock.yaml":              rbac.IMEXLock,
		"deployments/rbac/controller.yaml":             rbac.Controller,
		"deployments/webhook/webhook.yaml":             webhookconfig.Configuration,
		"deployments/crds/gang.tessera.dev_gangs.yaml": crds.Gang,
	}
	classes, err := deviceclass.Files()
	if err != nil {
		t.Fatal(err)
	}
	for name, data := range classes {
		files["deviceclass/"+name] = data
	}
	return files
}

// objectKey names an object: kind namespace/name.
func objectKey(u *unstructured.Unstructured) string {
	return fmt.Sprintf("%s %s/%s", u.GetKind(), u.GetNamespace(), u.GetName())
}

// decodeAll decodes a YAML stream into objects.
func decodeAll(data []byte) ([]*unstructured.Unstructured, error) {
	var out []*unstructured.Unstructured
	d := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096)
	for {
		var u unstructured.Unstructured
		if err := d.Decode(&u.Object); err != nil {
			if errors.Is(err, io.EOF) {
				return out, nil
			}
			return nil, err
		}
		if len(u.Object) > 0 {
			out = append(out, &u)
		}
	}
}

// withoutChartLabels drops the labels only the chart sets: Helm's
// app.kubernetes.io/* and helm.sh/chart on every object, the Pod Security
// level on the namespace.
func withoutChartLabels(u *unstructured.Unstructured) *unstructured.Unstructured {
	u = u.DeepCopy()
	labels := u.GetLabels()
	maps.DeleteFunc(labels, func(k, _ string) bool {
		return strings.HasPrefix(k, "app.kubernetes.io/") || k == "helm.sh/chart" ||
			(u.GetKind() == "Namespace" && strings.HasPrefix(k, "pod-security.kubernetes.io/"))
	})
	u.SetLabels(labels)
	if len(labels) == 0 {
		unstructured.RemoveNestedField(u.Object, "metadata", "labels")
	}
	return u
}

// TestChartMatchesEmbeddedManifests holds the single source of truth: the
// DeviceClasses, RBAC, node-lock policy, CRD and webhook configuration the
// chart renders (for the embedded files' namespace, with the webhook on
// through cert-manager as webhook.yaml assumes) are, field for field after
// decoding, the embedded YAML the tests install; and the chart has no object
// of those kinds that the embedded files lack. Change both together.
func TestChartMatchesEmbeddedManifests(t *testing.T) {
	values := map[string]any{
		"namespace": map[string]any{"create": true},
		"webhook":   map[string]any{"enabled": true, "certManager": map[string]any{"enabled": true}},
	}
	manifests, err := Render(context.Background(), values, DefaultRelease)
	if err != nil {
		t.Fatal(err)
	}
	chart := map[string]*unstructured.Unstructured{}
	for _, m := range manifests {
		objs, err := decodeAll([]byte(m.YAML))
		if err != nil {
			t.Fatalf("%s: %v", m.Source, err)
		}
		for _, u := range objs {
			chart[objectKey(u)] = withoutChartLabels(u)
		}
	}

	embedded := map[string]bool{}
	files := embeddedManifests(t)
	for _, file := range slices.Sorted(maps.Keys(files)) {
		objs, err := decodeAll(files[file])
		if err != nil {
			t.Fatalf("%s: %v", file, err)
		}
		for _, want := range objs {
			key := objectKey(want)
			embedded[key] = true
			got, ok := chart[key]
			if !ok {
				t.Errorf("%s: %s is not in the chart", file, key)
				continue
			}
			if diff := cmp.Diff(want.Object, got.Object); diff != "" {
				t.Errorf("%s: %s differs in the chart (-%s +chart):\n%s", file, key, file, diff)
			}
		}
	}
	for _, key := range slices.Sorted(maps.Keys(chart)) {
		if slices.Contains(sharedKinds, chart[key].GetKind()) && !embedded[key] {
			t.Errorf("the chart renders %s, which no embedded manifest has; add it there too, so that tests install it", key)
		}
	}
	if len(embedded) < 20 {
		t.Errorf("only %d embedded objects compared; the embedded files are not being read", len(embedded))
	}
}
