package simulate

import (
	"context"
	"fmt"
	"sort"
	"strconv"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	resourceinformers "k8s.io/client-go/informers/resource/v1"
	resourcelisters "k8s.io/client-go/listers/resource/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/dynamic-resource-allocation/resourceclaim"
	"k8s.io/dynamic-resource-allocation/resourceslice/tracker"
)

// Taint returns the slices as kube-scheduler's allocator sees them: each
// DeviceTaintRule's taint added to the devices its selector names. It runs
// the scheduler's own code for that, the ResourceSlice tracker of
// k8s.io/dynamic-resource-allocation/resourceslice/tracker (kube-scheduler
// v1.37.2 starts one over its informers, pkg/scheduler/scheduler.go, and
// allocates from ListPatchedResourceSlices), here over informers that hold
// exactly these objects: the view is the one read, patched as the scheduler
// patches it, with no rule matching of our own to drift from upstream.
// The order of slices is kept; a slice no rule selects may come back as a
// copy. The inputs are not modified.
func Taint(ctx context.Context, slices []*resourceapi.ResourceSlice, rules []*resourceapi.DeviceTaintRule) ([]*resourceapi.ResourceSlice, error) {
	if len(slices) == 0 || len(rules) == 0 {
		return slices, nil
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// The tracker keys objects by name: index names keep two objects that
	// share a name (or have none, in tests) apart. Shallow copies: only the
	// name is changed, and the tracker deep-copies a slice it patches.
	sliceList := &resourceapi.ResourceSliceList{Items: make([]resourceapi.ResourceSlice, len(slices))}
	for i, s := range slices {
		sliceList.Items[i] = *s
		sliceList.Items[i].Name = strconv.Itoa(i)
	}
	ruleList := &resourceapi.DeviceTaintRuleList{Items: make([]resourceapi.DeviceTaintRule, len(rules))}
	for i, r := range rules {
		ruleList.Items[i] = *r
		ruleList.Items[i].Name = strconv.Itoa(i)
	}
	sliceInf := cache.NewSharedIndexInformer(fixedList{sliceList}, &resourceapi.ResourceSlice{}, 0, cache.Indexers{})
	ruleInf := cache.NewSharedIndexInformer(fixedList{ruleList}, &resourceapi.DeviceTaintRule{}, 0, cache.Indexers{})
	t, err := tracker.StartTracker(ctx, tracker.Options{
		EnableDeviceTaintRules:   true,
		EnableConsumableCapacity: Features.ConsumableCapacity,
		SliceInformer:            sliceInformer{sliceInf},
		TaintInformer:            ruleInformer{ruleInf},
	})
	if err != nil {
		return nil, fmt.Errorf("start the ResourceSlice tracker: %w", err)
	}
	defer t.Stop()
	go sliceInf.Run(ctx.Done())
	go ruleInf.Run(ctx.Done())
	select {
	case <-t.HasSyncedChecker().Done():
	case <-ctx.Done():
		return nil, fmt.Errorf("apply DeviceTaintRules to the slices: %w", context.Cause(ctx))
	}
	patched, err := t.ListPatchedResourceSlices()
	if err != nil {
		return nil, fmt.Errorf("apply DeviceTaintRules to the slices: %w", err)
	}
	if len(patched) != len(slices) {
		return nil, fmt.Errorf("apply DeviceTaintRules to the slices: the tracker returned %d of %d slices", len(patched), len(slices))
	}
	out := make([]*resourceapi.ResourceSlice, len(slices))
	for _, p := range patched {
		i, err := strconv.Atoi(p.Name)
		if err != nil || i < 0 || i >= len(slices) || out[i] != nil {
			return nil, fmt.Errorf("apply DeviceTaintRules to the slices: the tracker returned an unknown slice %q", p.Name)
		}
		p.Name = slices[i].Name // p is the tracker's copy or ours
		out[i] = p
	}
	return out, nil
}

// fixedList lists its objects and watches nothing: an informer over it
// holds exactly them.
type fixedList struct{ list runtime.Object }

func (f fixedList) List(metav1.ListOptions) (runtime.Object, error) { return f.list, nil }

func (f fixedList) Watch(metav1.ListOptions) (watch.Interface, error) { return watch.NewFake(), nil }

func (f fixedList) ListWithContext(context.Context, metav1.ListOptions) (runtime.Object, error) {
	return f.list, nil
}

func (f fixedList) WatchWithContext(context.Context, metav1.ListOptions) (watch.Interface, error) {
	return watch.NewFake(), nil
}

// IsWatchListSemanticsUnSupported keeps the reflector to a plain list
// (client-go's WatchListClient would wait for a watch's initial events).
func (fixedList) IsWatchListSemanticsUnSupported() bool { return true }

// sliceInformer and ruleInformer are the typed informers the tracker takes.
type sliceInformer struct{ cache.SharedIndexInformer }

func (s sliceInformer) Informer() cache.SharedIndexInformer { return s.SharedIndexInformer }

func (s sliceInformer) TypedInformer() resourceinformers.ResourceSliceIndexInformer {
	return cache.NewTypedSharedIndexInformer[*resourceapi.ResourceSlice](s.SharedIndexInformer)
}

func (s sliceInformer) Lister() resourcelisters.ResourceSliceLister {
	return resourcelisters.NewResourceSliceLister(s.GetIndexer())
}

type ruleInformer struct{ cache.SharedIndexInformer }

func (r ruleInformer) Informer() cache.SharedIndexInformer { return r.SharedIndexInformer }

func (r ruleInformer) TypedInformer() resourceinformers.DeviceTaintRuleIndexInformer {
	return cache.NewTypedSharedIndexInformer[*resourceapi.DeviceTaintRule](r.SharedIndexInformer)
}

func (r ruleInformer) Lister() resourcelisters.DeviceTaintRuleLister {
	return resourcelisters.NewDeviceTaintRuleLister(r.GetIndexer())
}

// Untolerated describes, for a message, the taints on the devices of slices
// that keep the allocator from them (effect NoSchedule or NoExecute) and
// that tolerations do not tolerate: each once, sorted, as
// "key=value:Effect", with " (DeviceTaintRule <name>)" when one of rules
// carries that taint and selects the device. The allocator decides; this
// only names what it saw.
func Untolerated(slices []*resourceapi.ResourceSlice, rules []*resourceapi.DeviceTaintRule, tolerations []resourceapi.DeviceToleration) []string {
	seen := map[string]bool{}
	var out []string
	for _, s := range slices {
		for _, d := range s.Spec.Devices {
			for _, taint := range d.Taints {
				if taint.Effect != resourceapi.DeviceTaintEffectNoSchedule && taint.Effect != resourceapi.DeviceTaintEffectNoExecute {
					continue
				}
				if tolerated(taint, tolerations) {
					continue
				}
				what := describeTaint(taint)
				if rule := ruleOf(rules, s, d.Name, taint); rule != "" {
					what += " (DeviceTaintRule " + rule + ")"
				}
				if !seen[what] {
					seen[what] = true
					out = append(out, what)
				}
			}
		}
	}
	sort.Strings(out)
	return out
}

func tolerated(taint resourceapi.DeviceTaint, tolerations []resourceapi.DeviceToleration) bool {
	for _, t := range tolerations {
		if resourceclaim.ToleratesTaint(t, taint) {
			return true
		}
	}
	return false
}

// describeTaint writes a taint as kubectl writes a node's: key=value:Effect.
func describeTaint(t resourceapi.DeviceTaint) string {
	var b strings.Builder
	b.WriteString(t.Key)
	if t.Value != "" {
		b.WriteString("=" + t.Value)
	}
	b.WriteString(":" + string(t.Effect))
	return b.String()
}

// ruleOf names the first rule (by name) that selects the device and
// carries the taint; "" when none does (the taint is the slice's own).
func ruleOf(rules []*resourceapi.DeviceTaintRule, s *resourceapi.ResourceSlice, device string, taint resourceapi.DeviceTaint) string {
	var names []string
	for _, r := range rules {
		sel := r.Spec.DeviceSelector
		if sel == nil || r.Spec.Taint.Key != taint.Key || r.Spec.Taint.Value != taint.Value || r.Spec.Taint.Effect != taint.Effect {
			continue
		}
		if (sel.Driver == nil || *sel.Driver == s.Spec.Driver) && (sel.Pool == nil || *sel.Pool == s.Spec.Pool.Name) && (sel.Device == nil || *sel.Device == device) {
			names = append(names, r.Name)
		}
	}
	if len(names) == 0 {
		return ""
	}
	sort.Strings(names)
	return names[0]
}
