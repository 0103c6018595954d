// Package examples_test checks the example manifests operators copy: every
// file decodes strictly as Kubernetes objects, and each claim template is
// placed by the scheduler's own allocator exactly where it should be.
package examples_test

import (
	"bytes"
	"context"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer/json"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes/scheme"

	"github.com/tessera-dev/tessera/api/gpu/v1alpha1"
	"github.com/tessera-dev/tessera/deviceclass"
	"github.com/tessera-dev/tessera/driver/discovery"
	"github.com/tessera-dev/tessera/driver/fakenode"
	"github.com/tessera-dev/tessera/driver/inventory"
	"github.com/tessera-dev/tessera/driver/simulate"
	"github.com/tessera-dev/tessera/test/fixtures"
)

// objects decodes every YAML file under this directory, strictly.
func objects(t *testing.T) map[string][]runtime.Object {
	t.Helper()
	codec := json.NewSerializerWithOptions(json.DefaultMetaFactory, scheme.Scheme, scheme.Scheme, json.SerializerOptions{Yaml: true, Strict: true})
	out := map[string][]runtime.Object{}
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, ".yaml") {
			return err
		}
		data, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		r := utilyaml.NewYAMLReader(bufioReader(data))
		for {
			doc, err := r.Read()
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Fatalf("%s: %v", path, err)
			}
			if len(bytes.TrimSpace(doc)) == 0 {
				continue
			}
			obj, _, err := codec.Decode(doc, nil, nil)
			if err != nil {
				t.Errorf("%s: %v", path, err)
				continue
			}
			out[path] = append(out[path], obj)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// fits says, per example file, on which simulated nodes its claims must be
// allocatable; every other profile must refuse them.
var fits = map[string][]string{
	"mig/one-1g.yaml":        {"dgx-h100"},
	"mig/h100-3g.yaml":       {"dgx-h100"},
	"mig/2g-or-l4.yaml":      {"dgx-h100", "dgx-h200", "dgx-b200", "gb200-nvl72-tray", "pcie-l4x4"},
	"sharing/power-cap.yaml": {"dgx-h100"},
	"sharing/mps.yaml":       {"dgx-a100", "dgx-h100", "dgx-h200", "dgx-b200", "gb200-nvl72-tray", "pcie-l4x4"},
	// Shared classes select only GPUs an operator shares: every node here
	// shares GPU 0 by time and GPU 1 by memory (sharedNode).
	"sharing/time-slices.yaml":               {"dgx-a100", "dgx-h100", "dgx-h200", "dgx-b200", "gb200-nvl72-tray", "pcie-l4x4"},
	"sharing/memory-share.yaml":              {"dgx-a100", "dgx-h100", "dgx-h200", "dgx-b200", "gb200-nvl72-tray", "pcie-l4x4"},
	"sharing/time-slicing-shared-claim.yaml": {"dgx-a100", "dgx-h100", "dgx-h200", "dgx-b200", "gb200-nvl72-tray", "pcie-l4x4"},
}

// sharedNode shares GPU 0 in four time slices and GPU 1 by memory.
func sharedNode(g discovery.GPU) inventory.Share {
	switch g.Index {
	case 0:
		return inventory.Share{TimeSlices: 4}
	case 1:
		return inventory.Share{Memory: true}
	}
	return inventory.Share{}
}

func TestExamplesDecodeAndPlaceWhereTheySay(t *testing.T) {
	classes, err := deviceclass.All()
	if err != nil {
		t.Fatal(err)
	}
	profiles := fakenode.Profiles()
	clusters := map[string]*simulate.Cluster{}
	for _, p := range profiles {
		clusters[p] = simulate.New(classes, fixtures.Slices(t, fixtures.Profile(t, p), p, inventory.Options{DynamicMIG: true, Sharing: sharedNode}))
	}
	objs := objects(t)
	if len(objs) == 0 {
		t.Fatal("no example manifests found")
	}
	for file, want := range fits {
		var templates []*resourceapi.ResourceClaimTemplate
		for _, o := range objs[file] {
			switch o := o.(type) {
			case *resourceapi.ResourceClaimTemplate:
				templates = append(templates, o)
			case *resourceapi.ResourceClaim:
				templates = append(templates, &resourceapi.ResourceClaimTemplate{ObjectMeta: o.ObjectMeta, Spec: resourceapi.ResourceClaimTemplateSpec{Spec: o.Spec}})
			}
		}
		if len(templates) == 0 {
			t.Errorf("%s: no ResourceClaimTemplate", file)
			continue
		}
		for _, tpl := range templates {
			claim := &resourceapi.ResourceClaim{Spec: *tpl.Spec.Spec.DeepCopy()}
			applyDefaults(&claim.Spec)
			claim.Name, claim.Namespace, claim.UID = tpl.Name, "default", "uid-"+tpl.UID
			for _, p := range profiles {
				res, err := clusters[p].Allocate(context.Background(), p, claim)
				if err != nil {
					t.Errorf("%s on %s: %v", file, p, err)
					continue
				}
				should := contains(want, p)
				if (res != nil) != should {
					t.Errorf("%s on %s: allocated %v, want %v", file, p, res != nil, should)
				}
			}
		}
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// applyDefaults sets what the API server defaults in a claim spec (its
// defaulting code lives in k8s.io/kubernetes, not in the client libraries):
// ExactCount allocation of one device.
func applyDefaults(spec *resourceapi.ResourceClaimSpec) {
	one := func(mode *resourceapi.DeviceAllocationMode, count *int64) {
		if *mode == "" {
			*mode = resourceapi.DeviceAllocationModeExactCount
		}
		if *mode == resourceapi.DeviceAllocationModeExactCount && *count == 0 {
			*count = 1
		}
	}
	for i := range spec.Devices.Requests {
		r := &spec.Devices.Requests[i]
		if r.Exactly != nil {
			one(&r.Exactly.AllocationMode, &r.Exactly.Count)
		}
		for j := range r.FirstAvailable {
			one(&r.FirstAvailable[j].AllocationMode, &r.FirstAvailable[j].Count)
		}
	}
}

// TestExampleConfigsDecode checks every Tessera opaque config in the
// examples with the code the plugin and the webhook use.
func TestExampleConfigsDecode(t *testing.T) {
	checked := 0
	for file, objs := range objects(t) {
		for _, o := range objs {
			var configs []resourceapi.DeviceClaimConfiguration
			switch o := o.(type) {
			case *resourceapi.ResourceClaim:
				configs = o.Spec.Devices.Config
			case *resourceapi.ResourceClaimTemplate:
				configs = o.Spec.Spec.Devices.Config
			}
			for _, c := range configs {
				checked += checkConfig(t, file, c.Opaque)
			}
		}
	}
	classes, err := deviceclass.All()
	if err != nil {
		t.Fatal(err)
	}
	for _, dc := range classes {
		for _, c := range dc.Spec.Config {
			checked += checkConfig(t, "DeviceClass "+dc.Name, c.Opaque)
		}
	}
	if checked < 4 {
		t.Errorf("checked %d configs; the sharing examples and the MPS class have at least 4", checked)
	}
}

// checkConfig decodes and validates a Tessera opaque config as the plugin
// does, reporting errors against where; it returns 1 if the config was
// Tessera's, else 0.
func checkConfig(t *testing.T, where string, c *resourceapi.OpaqueDeviceConfiguration) int {
	t.Helper()
	if c == nil || c.Driver != "gpu.tessera.dev" {
		return 0
	}
	cfg, err := v1alpha1.Decode(c.Parameters.Raw)
	if err == nil {
		err = v1alpha1.Validate(cfg).ToAggregate()
	}
	if err != nil {
		t.Errorf("%s: %v", where, err)
	}
	return 1
}
