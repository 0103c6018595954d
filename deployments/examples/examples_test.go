// Package examples_test checks the example manifests operators copy: every
// file decodes strictly as Kubernetes objects, and each claim template is
// placed by the scheduler's own allocator exactly where it should be.
package examples_test

import (
	"bytes"
	"context"
	"io"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer/json"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes/scheme"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/api/gpu/v1alpha1"
	"github.com/tessera-dev/tessera/deviceclass"
	"github.com/tessera-dev/tessera/driver/discovery"
	"github.com/tessera-dev/tessera/driver/fakenode"
	"github.com/tessera-dev/tessera/driver/inventory"
	"github.com/tessera-dev/tessera/driver/simulate"
	"github.com/tessera-dev/tessera/test/fixtures"
)

// examplesScheme knows Kubernetes' types and Tessera's Gang.
func examplesScheme(t *testing.T) *runtime.Scheme {
	t.Helper()
	s := runtime.NewScheme()
	if err := scheme.AddToScheme(s); err != nil {
		t.Fatal(err)
	}
	gv := schema.GroupVersion{Group: gangv1.Group, Version: gangv1.Version}
	s.AddKnownTypes(gv, &gangv1.Gang{}, &gangv1.GangList{})
	metav1.AddToGroupVersion(s, gv)
	return s
}

// objects decodes every YAML file under this directory, strictly.
func objects(t *testing.T) map[string][]runtime.Object {
	t.Helper()
	s := examplesScheme(t)
	codec := json.NewSerializerWithOptions(json.DefaultMetaFactory, s, s, json.SerializerOptions{Yaml: true, Strict: true})
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
	"sharing/mps.yaml":       {"dgx-a100", "dgx-a100-80gb", "dgx-h100", "dgx-h200", "dgx-b200", "gb200-nvl72-tray", "pcie-l4x4"},
	// Shared classes select only GPUs an operator shares: every node here
	// shares GPU 0 by time and GPU 1 by memory (sharedNode).
	"sharing/time-slices.yaml":               {"dgx-a100", "dgx-a100-80gb", "dgx-h100", "dgx-h200", "dgx-b200", "gb200-nvl72-tray", "pcie-l4x4"},
	"sharing/memory-share.yaml":              {"dgx-a100", "dgx-a100-80gb", "dgx-h100", "dgx-h200", "dgx-b200", "gb200-nvl72-tray", "pcie-l4x4"},
	"sharing/time-slicing-shared-claim.yaml": {"dgx-a100", "dgx-a100-80gb", "dgx-h100", "dgx-h200", "dgx-b200", "gb200-nvl72-tray", "pcie-l4x4"},
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

// TestGangExamplesHoldTogether checks what a gang example needs to start at
// all: a valid Gang whose selector (or, with roles, each role's) picks a
// Job's pods, as many as the Job runs at once, each gated and, if the gang
// has a domain claim, sharing it. With roles, every role's pods are also
// the gang's.
func TestGangExamplesHoldTogether(t *testing.T) {
	found := 0
	for file, objs := range objects(t) {
		jobs := map[string]*batchv1.Job{}
		claims := map[string]*resourceapi.ResourceClaim{}
		var gangs []*gangv1.Gang
		for _, o := range objs {
			switch o := o.(type) {
			case *batchv1.Job:
				jobs[o.Name] = o
			case *resourceapi.ResourceClaim:
				claims[o.Name] = o
			case *gangv1.Gang:
				gangs = append(gangs, o)
			}
		}
		for _, g := range gangs {
			found++
			if _, err := gangv1.Validate(g); err != nil {
				t.Errorf("%s: gang %s: %v", file, g.Name, err)
				continue
			}
			// An elastic gang's Job runs its most members.
			_, most := gangv1.Bounds(&g.Spec)
			groups := []gangv1.Role{{Name: g.Name, Size: most, Selector: g.Spec.Selector}}
			if len(g.Spec.Roles) > 0 {
				groups = g.Spec.Roles
			}
			if g.Spec.DomainClaimName != "" {
				dc := claims[g.Spec.DomainClaimName]
				if dc == nil || len(dc.Spec.Devices.Requests) != 1 || dc.Spec.Devices.Requests[0].Exactly == nil || dc.Spec.Devices.Requests[0].Exactly.DeviceClassName != "domain.gpu.tessera.dev" {
					t.Errorf("%s: gang %s's domain claim %q is not a claim of domain.gpu.tessera.dev in the file", file, g.Name, g.Spec.DomainClaimName)
				}
			}
			for _, group := range groups {
				job := jobs[group.Selector.MatchLabels[batchv1.JobNameLabel]]
				if job == nil || len(group.Selector.MatchLabels) != 1 || len(group.Selector.MatchExpressions) != 0 {
					t.Errorf("%s: gang %s (%s) selects %v, want exactly the pods of a Job in the file (%s=<job>)", file, g.Name, group.Name, group.Selector, batchv1.JobNameLabel)
					continue
				}
				checkGangJob(t, file, g, job, group.Size)
			}
		}
	}
	if found < 6 {
		t.Errorf("found %d gang examples, want the NVLink, rack, spread, launcher-workers, elastic and priority ones", found)
	}
}

// checkMemberJob checks what every Job of gang members needs: n indexed
// pods (n is what the gang counts on, said by of), evictions ignored, and
// the gate that keeps each pod until its gang is placed.
func checkMemberJob(t *testing.T, file string, job *batchv1.Job, n int32, of string) {
	t.Helper()
	if job.Spec.Parallelism == nil || *job.Spec.Parallelism != n || job.Spec.Completions == nil || *job.Spec.Completions != n ||
		job.Spec.CompletionMode == nil || *job.Spec.CompletionMode != batchv1.IndexedCompletion {
		t.Errorf("%s: Job %s must be Indexed with completions and parallelism %d (%s)", file, job.Name, n, of)
	}
	if !ignoresEvictions(job.Spec.PodFailurePolicy) {
		t.Errorf("%s: Job %s must ignore DisruptionTarget failures (podFailurePolicy): the controller evicts the members of a gang that lost one", file, job.Name)
	}
	if !slices.ContainsFunc(job.Spec.Template.Spec.SchedulingGates, func(sg corev1.PodSchedulingGate) bool { return sg.Name == gangv1.SchedulingGate }) {
		t.Errorf("%s: Job %s's pods lack the scheduling gate %s: the scheduler would place them one by one", file, job.Name, gangv1.SchedulingGate)
	}
}

// checkGangJob checks one Job of gang g that runs size of its members.
func checkGangJob(t *testing.T, file string, g *gangv1.Gang, job *batchv1.Job, size int32) {
	t.Helper()
	checkMemberJob(t, file, job, size, "its members")
	pod := job.Spec.Template.Spec
	podLabels := labels.Set(maps.Clone(job.Spec.Template.Labels))
	if podLabels == nil {
		podLabels = labels.Set{}
	}
	podLabels[batchv1.JobNameLabel] = job.Name
	if sel, err := metav1.LabelSelectorAsSelector(&g.Spec.Selector); err != nil || !sel.Matches(podLabels) {
		t.Errorf("%s: gang %s's selector %v does not pick Job %s's pods (labels %v): %v", file, g.Name, g.Spec.Selector, job.Name, podLabels, err)
	}
	if g.Spec.DomainClaimName != "" && !slices.ContainsFunc(pod.ResourceClaims, func(rc corev1.PodResourceClaim) bool {
		return rc.ResourceClaimName != nil && *rc.ResourceClaimName == g.Spec.DomainClaimName
	}) {
		t.Errorf("%s: Job %s's pods do not share the domain claim %s", file, job.Name, g.Spec.DomainClaimName)
	}
}

func ignoresEvictions(p *batchv1.PodFailurePolicy) bool {
	if p == nil {
		return false
	}
	for _, r := range p.Rules {
		for _, c := range r.OnPodConditions {
			if r.Action == batchv1.PodFailurePolicyActionIgnore && c.Type == corev1.DisruptionTarget {
				return true
			}
		}
	}
	return false
}
