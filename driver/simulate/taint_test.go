package simulate

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/cache"
	"k8s.io/dynamic-resource-allocation/resourceslice/tracker"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/ptr"
)

func slice(name, driver, pool string, devices ...string) *resourceapi.ResourceSlice {
	s := &resourceapi.ResourceSlice{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec:       resourceapi.ResourceSliceSpec{Driver: driver, Pool: resourceapi.ResourcePool{Name: pool, ResourceSliceCount: 1}, NodeName: ptr.To(pool)},
	}
	for _, d := range devices {
		s.Spec.Devices = append(s.Spec.Devices, resourceapi.Device{Name: d})
	}
	return s
}

func rule(name string, driver, pool, device *string, key string, effect resourceapi.DeviceTaintEffect) *resourceapi.DeviceTaintRule {
	r := &resourceapi.DeviceTaintRule{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: resourceapi.DeviceTaintRuleSpec{
			DeviceSelector: &resourceapi.DeviceTaintSelector{Driver: driver, Pool: pool, Device: device},
			Taint:          resourceapi.DeviceTaint{Key: key, Value: name, Effect: effect},
		},
	}
	if driver == nil && pool == nil && device == nil {
		r.Spec.DeviceSelector = nil // selects nothing
	}
	return r
}

// tainted is what the scheduler sees: the slices patched by a tracker
// started as kube-scheduler v1.37.2 starts it, over informers of a
// clientset holding the objects.
func tainted(t *testing.T, objs []runtime.Object) map[string]*resourceapi.ResourceSlice {
	t.Helper()
	_, ctx := ktesting.NewTestContext(t)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	client := fake.NewClientset(objs...)
	factory := informers.NewSharedInformerFactory(client, 0)
	tr, err := tracker.StartTracker(ctx, tracker.Options{
		EnableDeviceTaintRules: true, EnableConsumableCapacity: true,
		SliceInformer: factory.Resource().V1().ResourceSlices(),
		TaintInformer: factory.Resource().V1().DeviceTaintRules(),
		KubeClient:    client,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Stop()
	factory.Start(ctx.Done())
	defer func() {
		cancel() // Shutdown waits for the informers, which stop with ctx
		factory.Shutdown()
	}()
	if !cache.WaitForCacheSync(ctx.Done(), tr.HasSynced) {
		t.Fatal("tracker did not sync")
	}
	list, err := tr.ListPatchedResourceSlices()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]*resourceapi.ResourceSlice{}
	for _, s := range list {
		out[s.Name] = s
	}
	return out
}

// sortedTaints is a copy of s with each device's taints sorted.
func sortedTaints(s *resourceapi.ResourceSlice) *resourceapi.ResourceSlice {
	s = s.DeepCopy()
	for i := range s.Spec.Devices {
		slices.SortFunc(s.Spec.Devices[i].Taints, func(a, b resourceapi.DeviceTaint) int {
			return strings.Compare(a.Key+"="+a.Value+":"+string(a.Effect), b.Key+"="+b.Value+":"+string(b.Effect))
		})
	}
	return s
}

// Taint gives what the scheduler's informer-fed tracker gives, for rules
// selecting by driver, pool, device, all three, none (nothing) and another
// driver; it keeps the order of the slices and changes none of its inputs.
func TestTaintSeesTheSlicesAsTheSchedulersTrackerDoes(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	const gpu, nic = "gpu.tessera.dev", "nic.example.com"
	in := []*resourceapi.ResourceSlice{
		slice("tray-b1-gpus", gpu, "b1", "gpu-0", "gpu-1"),
		slice("tray-a1-gpus", gpu, "a1", "gpu-0", "gpu-1"),
		slice("tray-a1-nics", nic, "a1", "nic-0"),
	}
	in[1].Spec.Devices[1].Taints = []resourceapi.DeviceTaint{{Key: "gpu.tessera.dev/xid", Effect: resourceapi.DeviceTaintEffectNoExecute}}
	rules := []*resourceapi.DeviceTaintRule{
		rule("drain-a1", ptr.To(gpu), ptr.To("a1"), nil, "example.com/maintenance", resourceapi.DeviceTaintEffectNoSchedule),
		rule("every-gpu-1", ptr.To(gpu), nil, ptr.To("gpu-1"), "example.com/flaky", resourceapi.DeviceTaintEffectNoExecute),
		rule("one-device", ptr.To(gpu), ptr.To("b1"), ptr.To("gpu-0"), "example.com/one", resourceapi.DeviceTaintEffectNoSchedule),
		rule("all-of-pool-a1", nil, ptr.To("a1"), nil, "example.com/pool", resourceapi.DeviceTaintEffectNoSchedule),
		rule("other-driver", ptr.To("other.example.com"), nil, nil, "example.com/other", resourceapi.DeviceTaintEffectNoSchedule),
		rule("no-selector", nil, nil, nil, "example.com/none", resourceapi.DeviceTaintEffectNoSchedule),
	}
	var objs []runtime.Object
	var before []*resourceapi.ResourceSlice
	for _, s := range in {
		objs = append(objs, s.DeepCopy())
		before = append(before, s.DeepCopy())
	}
	for _, r := range rules {
		objs = append(objs, r.DeepCopy())
	}
	want := tainted(t, objs)

	got, err := Taint(ctx, in, rules)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(in) {
		t.Fatalf("got %d slices, want %d", len(got), len(in))
	}
	for i, s := range got {
		if s.Name != in[i].Name {
			t.Errorf("slice %d is %s, want %s (the order kept)", i, s.Name, in[i].Name)
		}
		// The tracker applies rules in its informer's (map) order: the
		// order of a device's taints is not part of the view.
		if w := want[s.Name]; !apiequality.Semantic.DeepEqual(sortedTaints(s).Spec, sortedTaints(w).Spec) {
			t.Errorf("slice %s:\n got %+v\nwant %+v (the scheduler's tracker)", s.Name, s.Spec.Devices, w.Spec.Devices)
		}
	}
	for i := range in {
		if !apiequality.Semantic.DeepEqual(in[i], before[i]) {
			t.Errorf("input slice %s changed: %+v", in[i].Name, in[i].Spec.Devices)
		}
	}
	// Spelled out, so that a tracker that applied nothing does not pass.
	if taints := got[1].Spec.Devices[1].Taints; len(taints) != 4 {
		t.Errorf("a1/gpu-1 taints %+v: want its own, drain-a1, every-gpu-1 and all-of-pool-a1", taints)
	}
	if taints := got[0].Spec.Devices[1].Taints; len(taints) != 1 || taints[0].Value != "every-gpu-1" {
		t.Errorf("b1/gpu-1 taints %+v: want every-gpu-1 alone", taints)
	}
}

// Slices that share a name (or have none) are kept apart, and no rules
// means the slices as given.
func TestTaintKeepsSlicesOfOneNameApart(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	in := []*resourceapi.ResourceSlice{slice("", "gpu.tessera.dev", "a1", "gpu-0"), slice("", "gpu.tessera.dev", "b1", "gpu-0")}
	same, err := Taint(ctx, in, nil)
	if err != nil || !slices.Equal(same, in) {
		t.Errorf("without rules: %v, %v; want the slices as given", same, err)
	}
	got, err := Taint(ctx, in, []*resourceapi.DeviceTaintRule{rule("drain-b1", nil, ptr.To("b1"), nil, "example.com/maintenance", resourceapi.DeviceTaintEffectNoSchedule)})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0].Spec.Pool.Name != "a1" || len(got[0].Spec.Devices[0].Taints) != 0 || got[1].Spec.Pool.Name != "b1" || len(got[1].Spec.Devices[0].Taints) != 1 || got[1].Name != "" {
		t.Errorf("got %+v", got)
	}
}

// Taint runs informers: a cancelled context ends it with an error, not a
// hang.
func TestTaintEndsWithItsContext(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	ctx, cancel := context.WithCancel(ctx)
	cancel()
	done := make(chan error, 1)
	go func() {
		_, err := Taint(ctx, []*resourceapi.ResourceSlice{slice("s", "d", "p", "x")}, []*resourceapi.DeviceTaintRule{rule("r", nil, ptr.To("p"), nil, "k", resourceapi.DeviceTaintEffectNoSchedule)})
		done <- err
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Taint did not return after its context ended")
	}
}

// Untolerated names the NoSchedule and NoExecute taints a toleration list
// does not tolerate, with the rule that carries each.
func TestUntoleratedNamesTheTaintsAndTheirRules(t *testing.T) {
	s := slice("a1", "gpu.tessera.dev", "a1", "gpu-0", "gpu-1")
	s.Spec.Devices[0].Taints = []resourceapi.DeviceTaint{
		{Key: "example.com/maintenance", Value: "drain-a1", Effect: resourceapi.DeviceTaintEffectNoSchedule},
		{Key: "gpu.tessera.dev/xid", Effect: resourceapi.DeviceTaintEffectNoExecute},
		{Key: "example.com/note", Effect: resourceapi.DeviceTaintEffectNone},
	}
	rules := []*resourceapi.DeviceTaintRule{rule("drain-a1", ptr.To("gpu.tessera.dev"), ptr.To("a1"), nil, "example.com/maintenance", resourceapi.DeviceTaintEffectNoSchedule)}
	got := Untolerated([]*resourceapi.ResourceSlice{s}, rules, nil)
	want := []string{"example.com/maintenance=drain-a1:NoSchedule (DeviceTaintRule drain-a1)", "gpu.tessera.dev/xid:NoExecute"}
	if !slices.Equal(got, want) {
		t.Errorf("got %q, want %q", got, want)
	}
	got = Untolerated([]*resourceapi.ResourceSlice{s}, rules, []resourceapi.DeviceToleration{{Key: "example.com/maintenance", Operator: resourceapi.DeviceTolerationOpExists}})
	if !slices.Equal(got, want[1:]) {
		t.Errorf("tolerating the drain: got %q, want %q", got, want[1:])
	}
}
