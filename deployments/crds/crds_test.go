package crds

import (
	"context"
	"strings"
	"testing"

	"k8s.io/apiextensions-apiserver/pkg/apis/apiextensions"
	"k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/install"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/schema"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/schema/cel"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/schema/listtype"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/validation"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	utiljson "k8s.io/apimachinery/pkg/util/json"
	celconfig "k8s.io/apiserver/pkg/apis/cel"
	"sigs.k8s.io/yaml"
)

// gangCRD decodes the Gang CRD and converts it to the internal type the API
// server validates.
func gangCRD(t *testing.T) *apiextensions.CustomResourceDefinition {
	t.Helper()
	s := runtime.NewScheme()
	install.Install(s)
	obj, _, err := serializer.NewCodecFactory(s).UniversalDeserializer().Decode(Gang, nil, nil)
	if err != nil {
		t.Fatalf("decode the Gang CRD: %v", err)
	}
	v1crd, ok := obj.(*apiextensionsv1.CustomResourceDefinition)
	if !ok {
		t.Fatalf("the Gang CRD decodes to %T", obj)
	}
	crd := &apiextensions.CustomResourceDefinition{}
	if err := s.Convert(v1crd, crd, nil); err != nil {
		t.Fatal(err)
	}
	return crd
}

// The CRD's schema and rules refuse the gangs Validate refuses for the same
// reason, so most mistakes are refused when written rather than reported
// later on the gang's status. The valid cases also hold that every rule
// compiles: a rule that does not is reported as an error on every object.
// (That the API server accepts the CRD itself is held by every gang test in
// test/e2e, which installs it.)
func TestGangCRDRefusesInvalidPoliciesAndRoles(t *testing.T) {
	crd := gangCRD(t)
	// The conversion hoists a schema all versions share to spec.validation.
	props := crd.Spec.Validation.OpenAPIV3Schema
	structural, err := schema.NewStructural(props)
	if err != nil {
		t.Fatal(err)
	}
	schemaValidator, _, err := validation.NewSchemaValidator(props)
	if err != nil {
		t.Fatal(err)
	}
	celValidator := cel.NewValidator(structural, true, celconfig.PerCallLimit)
	for _, tc := range []struct {
		name, spec string
		want       string // "" when valid
	}{
		{"plain", `{size: 2, selector: {matchLabels: {app: t}}}`, ""},
		{"spread", `{size: 2, selector: {matchLabels: {app: t}}, placement: {policy: Spread, topologyKey: rack, maxPerValue: 1, strength: Preferred}}`, ""},
		{"roles", `{size: 3, selector: {matchLabels: {app: t}}, roles: [{name: launcher, size: 1, selector: {matchLabels: {r: l}}}, {name: workers, size: 2, selector: {matchLabels: {r: w}}}]}`, ""},
		{"unknown policy", `{size: 2, placement: {policy: Scatter}}`, "spec.placement.policy"},
		{"unknown strength", `{size: 2, placement: {strength: Soft}}`, "spec.placement.strength"},
		{"spread without key", `{size: 2, placement: {policy: Spread, maxPerValue: 1}}`, "policy Spread needs topologyKey"},
		{"spread of zero", `{size: 2, placement: {policy: Spread, topologyKey: rack, maxPerValue: 0}}`, "spec.placement.maxPerValue"},
		{"pack with a key", `{size: 2, placement: {topologyKey: rack}}`, "apply to policy Spread only"},
		{"roles not summing to size", `{size: 2, roles: [{name: a, size: 1, selector: {matchLabels: {r: a}}}, {name: b, size: 2, selector: {matchLabels: {r: b}}}]}`, "sum of the roles' sizes"},
		{"role named twice", `{size: 2, roles: [{name: a, size: 1, selector: {matchLabels: {r: a}}}, {name: a, size: 1, selector: {matchLabels: {r: b}}}]}`, "Duplicate value"},
		{"role name not a label", `{size: 1, roles: [{name: A_b, size: 1, selector: {matchLabels: {r: a}}}]}`, "spec.roles[0].name"},
		{"roles of a PodGroup", `{size: 1, podGroupName: pg, roles: [{name: a, size: 1, selector: {matchLabels: {r: a}}}]}`, "spec.roles cannot be used with spec.podGroupName"},
		{"composite", `{size: 3, compositePodGroupName: serve, roles: [{name: prefill, size: 1, podGroupName: prefill, selector: {}}, {name: decode, size: 2, podGroupName: decode}]}`, ""},
		{"composite without roles", `{size: 3, compositePodGroupName: serve}`, "spec.compositePodGroupName needs spec.roles"},
		{"composite with a selector", `{size: 1, compositePodGroupName: serve, selector: {matchLabels: {app: t}}, roles: [{name: a, size: 1, podGroupName: a}]}`, "neither spec.selector nor spec.podGroupName"},
		{"composite role with a selector", `{size: 1, compositePodGroupName: serve, roles: [{name: a, size: 1, selector: {matchLabels: {r: a}}}]}`, "names its child PodGroup"},
		{"role with a selector and a PodGroup", `{size: 1, compositePodGroupName: serve, roles: [{name: a, size: 1, podGroupName: a, selector: {matchLabels: {r: a}}}]}`, "set exactly one"},
		{"role without a selector or a PodGroup", `{size: 1, selector: {matchLabels: {app: t}}, roles: [{name: a, size: 1}]}`, "set exactly one"},
		{"PodGroup role outside a composite", `{size: 1, selector: {matchLabels: {app: t}}, roles: [{name: a, size: 1, podGroupName: a}]}`, "spec.roles[].podGroupName is for the gang of a CompositePodGroup"},
		{"elastic", `{minSize: 2, maxSize: 4, selector: {matchLabels: {app: t}}}`, ""},
		{"elastic role", `{size: 3, roles: [{name: a, size: 1, selector: {matchLabels: {r: a}}}, {name: b, size: 2, minSize: 1, selector: {matchLabels: {r: b}}}]}`, ""},
		{"size and bounds", `{size: 4, minSize: 2, maxSize: 4}`, "set spec.size (a fixed gang), or spec.minSize and spec.maxSize"},
		{"neither size nor bounds", `{selector: {matchLabels: {app: t}}}`, "set spec.size (a fixed gang), or spec.minSize and spec.maxSize"},
		{"minimum alone", `{minSize: 2}`, "spec.minSize and spec.maxSize go together"},
		{"bounds upside down", `{minSize: 4, maxSize: 2}`, "spec.minSize must be at most spec.maxSize"},
		{"bounds with roles", `{minSize: 1, maxSize: 3, roles: [{name: a, size: 1, selector: {matchLabels: {r: a}}}, {name: b, size: 2, selector: {matchLabels: {r: b}}}]}`, "an elastic role sets roles[].minSize"},
		{"role minimum above its size", `{size: 2, roles: [{name: a, size: 2, minSize: 3, selector: {matchLabels: {r: a}}}]}`, "roles[].minSize must be at most the role's size"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// As the API server decodes: integers as int64.
			raw, err := yaml.YAMLToJSON([]byte(tc.spec))
			if err != nil {
				t.Fatal(err)
			}
			var spec map[string]any
			if err := utiljson.Unmarshal(raw, &spec); err != nil {
				t.Fatal(err)
			}
			obj := map[string]any{"apiVersion": "gang.tessera.dev/v1alpha1", "kind": "Gang", "metadata": map[string]any{"name": "g", "namespace": "ml"}, "spec": spec}
			errs := validation.ValidateCustomResource(nil, obj, schemaValidator)
			celErrs, _ := celValidator.Validate(context.Background(), nil, structural, obj, nil, celconfig.RuntimeCELCostBudget)
			errs = append(errs, celErrs...)
			errs = append(errs, listtype.ValidateListSetsAndMaps(nil, structural, obj)...)
			got := ""
			if len(errs) > 0 {
				got = errs.ToAggregate().Error()
			}
			switch {
			case tc.want == "" && got != "":
				t.Errorf("refused: %s", got)
			case tc.want != "" && !strings.Contains(got, tc.want):
				t.Errorf("errors %q, want one containing %q", got, tc.want)
			}
		})
	}
}
