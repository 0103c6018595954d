package cli

import (
	"bytes"
	"context"
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/utils/ptr"

	"github.com/tessera-dev/tessera/deviceclass"
	"github.com/tessera-dev/tessera/driver/inventory"
	"github.com/tessera-dev/tessera/test/fixtures"
)

func gpuClaim(name string, count int64, match string) *resourceapi.ResourceClaim {
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "ml", Name: name}}
	c.UID = types.UID("uid-" + c.Name)
	c.Spec.Devices.Requests = []resourceapi.DeviceRequest{{Name: "gpus", Exactly: &resourceapi.ExactDeviceRequest{
		DeviceClassName: "gpu.tessera.dev", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: count,
	}}}
	if match != "" {
		c.Spec.Devices.Constraints = []resourceapi.DeviceConstraint{{Requests: []string{"gpus"}, MatchAttribute: ptr.To(resourceapi.FullyQualifiedName(match))}}
	}
	return c
}

// TestExplainSaysWhatEachNodeLacks: a pending claim for five GPUs on one
// NVLink domain, on an L4 node (four GPUs, two taken) and a DGX split into
// two NVLink islands of four: each node is told its own shortfall.
func TestExplainSaysWhatEachNodeLacks(t *testing.T) {
	var objs []runtime.Object
	classes, err := deviceclass.All()
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range classes {
		objs = append(objs, c)
	}
	split := fixtures.Profile(t, "dgx-h100")
	split.NVLinkIslands = [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}}
	for _, s := range append(fixtures.Slices(t, fixtures.Profile(t, "pcie-l4x4"), "l4", inventory.Options{}), fixtures.Slices(t, split, "dgx", inventory.Options{})...) {
		objs = append(objs, s)
	}
	taken := gpuClaim("taken", 2, "")
	taken.Status.Allocation = &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{
		{Request: "gpus", Driver: "gpu.tessera.dev", Pool: "l4", Device: "gpu-0"},
		{Request: "gpus", Driver: "gpu.tessera.dev", Pool: "l4", Device: "gpu-1"},
	}}}
	objs = append(objs, taken, gpuClaim("big", 5, "gpu.tessera.dev/nvlinkDomain"), gpuClaim("small", 1, ""))
	client := fake.NewClientset(objs...)

	got := explained(t, client, "big",
		"l4: does not fit: request gpus needs 5, 4 devices match its class and selectors, 2 of them free",
		"dgx: does not fit: enough free devices match each request, but not together")
	var out bytes.Buffer
	if strings.Index(got, "dgx:") > strings.Index(got, "l4:") {
		t.Errorf("the closest node (dgx, short only a constraint) is not listed first:\n%s", got)
	}

	out.Reset()
	if err := Explain(context.Background(), &out, client, "ml", "small"); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "dgx: fits now") || !strings.Contains(out.String(), "l4: fits now") {
		t.Errorf("a one-GPU claim should fit on both nodes:\n%s", out.String())
	}
	out.Reset()
	if err := Explain(context.Background(), &out, client, "ml", "taken"); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "is allocated") || !strings.Contains(out.String(), "l4/gpu-1") {
		t.Errorf("an allocated claim should show its devices:\n%s", out.String())
	}
}

// TestExplainNamesTheRuleThatDrainsANode: an administrator's DeviceTaintRule
// drains the L4 node (NoSchedule on every device of its pool): a one-GPU
// claim is told it does not fit there because of the rule, as the scheduler
// would not allocate it there, and fits on the DGX; a claim that tolerates
// the taint fits on both.
func TestExplainNamesTheRuleThatDrainsANode(t *testing.T) {
	var objs []runtime.Object
	classes, err := deviceclass.All()
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range classes {
		objs = append(objs, c)
	}
	for _, s := range append(fixtures.Slices(t, fixtures.Profile(t, "pcie-l4x4"), "l4", inventory.Options{}), fixtures.Slices(t, fixtures.Profile(t, "dgx-h100"), "dgx", inventory.Options{})...) {
		objs = append(objs, s)
	}
	rule := &resourceapi.DeviceTaintRule{
		ObjectMeta: metav1.ObjectMeta{Name: "drain-l4"},
		Spec: resourceapi.DeviceTaintRuleSpec{
			DeviceSelector: &resourceapi.DeviceTaintSelector{Driver: ptr.To("gpu.tessera.dev"), Pool: ptr.To("l4")},
			Taint:          resourceapi.DeviceTaint{Key: "example.com/maintenance", Value: "drain", Effect: resourceapi.DeviceTaintEffectNoSchedule},
		},
	}
	tolerant := gpuClaim("tolerant", 1, "")
	tolerant.Spec.Devices.Requests[0].Exactly.Tolerations = []resourceapi.DeviceToleration{{Key: "example.com/maintenance", Operator: resourceapi.DeviceTolerationOpExists}}
	objs = append(objs, rule, gpuClaim("small", 1, ""), tolerant)
	client := fake.NewClientset(objs...)

	explained(t, client, "small",
		"dgx: fits now",
		"l4: does not fit: request gpus needs 1, 4 devices match its class and selectors, 4 of them carry taints it does not tolerate (example.com/maintenance=drain:NoSchedule (DeviceTaintRule drain-l4)), 0 of the others free")
	// A claim tolerating the drain fits on both nodes.
	explained(t, client, "tolerant", "dgx: fits now", "l4: fits now")
}

// explained runs Explain for claim ml/name and fails unless its output
// holds every wanted line; it returns the output.
func explained(t *testing.T, client *fake.Clientset, name string, wants ...string) string {
	t.Helper()
	var out bytes.Buffer
	if err := Explain(context.Background(), &out, client, "ml", name); err != nil {
		t.Fatal(err)
	}
	got := out.String()
	t.Log("\n" + got)
	for _, want := range wants {
		if !strings.Contains(got, want) {
			t.Errorf("explain of %s lacks %q:\n%s", name, want, got)
		}
	}
	return got
}
