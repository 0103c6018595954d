// Package nodelabels labels each GPU node with the NVLink domain and clique
// its GPUs publish (LabelDomain, LabelClique), so that the scheduler's
// topology-aware workload scheduling (a PodGroup's
// schedulingConstraints.topology), topologySpreadConstraints and node
// affinities can keep pods in one NVLink domain without Tessera's gangs.
//
// A node's labels come only from its own pool's ResourceSlices, which only
// its own kubelet plugin may write (the chart's admission policies): a
// node's token can move no label but its own node's. The controller writes
// no other label and nothing else of a Node (the chart's
// tessera-controller-nodes policy holds it to that), and removes its labels
// from a node that no longer publishes them.
package nodelabels

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"

	gpuslices "github.com/tessera-dev/tessera/driver/slices"
)

// The labels, in the driver's domain.
const (
	// LabelDomain is the multi-node NVLink domain of the node's GPUs: the
	// fabric's cluster UUID, the first part of their clique. (The GPUs'
	// nvlinkDomain attribute is another thing: the GPUs joined by NVLink
	// inside one node.)
	LabelDomain = gpuslices.DriverName + "/nvlink-domain"
	// LabelClique is the NVLink clique ("<cluster UUID>.<clique ID>") of
	// the node's GPUs: the nodes whose GPUs reach each other over NVLink.
	LabelClique = gpuslices.DriverName + "/nvlink-clique"
)

// labelNames are the labels the package owns.
var labelNames = []string{LabelDomain, LabelClique}

// Want is the labels each node should carry, by node name, from the
// driver's slices: for each node's pool its newest generation's devices'
// nvlinkClique attributes. A label is set only where every device that has
// the attribute agrees on it (GPUs of two cliques of one fabric give the
// node its domain and no clique) and its value is a valid label value. A
// node absent carries none.
func Want(resourceSlices []*resourceapi.ResourceSlice, driver string) map[string]map[string]string {
	newest := map[string]int64{} // pool -> generation
	for _, s := range resourceSlices {
		if s.Spec.Driver != driver || s.Spec.NodeName == nil || *s.Spec.NodeName == "" {
			continue
		}
		if g, ok := newest[s.Spec.Pool.Name]; !ok || s.Spec.Pool.Generation > g {
			newest[s.Spec.Pool.Name] = s.Spec.Pool.Generation
		}
	}
	values := map[string]map[string]map[string]bool{} // node -> label -> values
	add := func(node, label, value string) {
		if values[node] == nil {
			values[node] = map[string]map[string]bool{}
		}
		if values[node][label] == nil {
			values[node][label] = map[string]bool{}
		}
		values[node][label][value] = true
	}
	for _, s := range resourceSlices {
		if s.Spec.Driver != driver || s.Spec.NodeName == nil || *s.Spec.NodeName == "" || s.Spec.Pool.Generation != newest[s.Spec.Pool.Name] {
			continue
		}
		for _, d := range s.Spec.Devices {
			a, ok := d.Attributes[gpuslices.AttrNVLinkClique]
			if !ok || a.StringValue == nil || *a.StringValue == "" {
				continue
			}
			clique := *a.StringValue
			add(*s.Spec.NodeName, LabelClique, clique)
			if i := strings.LastIndex(clique, "."); i > 0 {
				add(*s.Spec.NodeName, LabelDomain, clique[:i])
			}
		}
	}
	out := map[string]map[string]string{}
	for node, byLabel := range values {
		for label, vs := range byLabel {
			if len(vs) != 1 {
				continue // several: no one of them is the node's
			}
			v := slices.Collect(maps.Keys(vs))[0]
			if len(validation.IsValidLabelValue(v)) > 0 {
				continue
			}
			if out[node] == nil {
				out[node] = map[string]string{}
			}
			out[node][label] = v
		}
	}
	return out
}

// Patch is the merge patch that gives a node the package's labels want
// (nil: none), removing those it has and should not; nil when nothing
// changes.
func Patch(node *v1.Node, want map[string]string) []byte {
	change := map[string]any{}
	for _, label := range labelNames {
		have, has := node.Labels[label]
		w, wanted := want[label]
		switch {
		case wanted && (!has || have != w):
			change[label] = w
		case !wanted && has:
			change[label] = nil
		}
	}
	if len(change) == 0 {
		return nil
	}
	// A map of strings and nils always marshals.
	data, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": change}})
	return data
}

// Options configure the labeller.
type Options struct {
	// Driver is the DRA driver whose node slices are read.
	Driver string
	// Retry is how long to wait after a failed write before trying again;
	// zero means 5 s.
	Retry time.Duration
}

// Start labels the nodes from the informers' nodes and slices, and again
// whenever they change, until ctx ends. The factory must be started by
// the caller.
func Start(ctx context.Context, client kubernetes.Interface, factory informers.SharedInformerFactory, opts Options) error {
	nodes := factory.Core().V1().Nodes().Informer()
	slicesInf := factory.Resource().V1().ResourceSlices().Informer()
	kick := make(chan struct{}, 1)
	changed := func() {
		select {
		case kick <- struct{}{}:
		default:
		}
	}
	handler := cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { changed() },
		UpdateFunc: func(any, any) { changed() },
		DeleteFunc: func(any) { changed() },
	}
	for _, inf := range []cache.SharedIndexInformer{nodes, slicesInf} {
		if _, err := inf.AddEventHandler(handler); err != nil {
			return fmt.Errorf("watch for node labels: %w", err)
		}
	}
	retry := opts.Retry
	if retry == 0 {
		retry = 5 * time.Second
	}
	go func() {
		logger := klog.FromContext(ctx).WithName("nodelabels")
		if !cache.WaitFor(ctx, "", nodes.HasSyncedChecker(), slicesInf.HasSyncedChecker()) {
			return
		}
		for {
			wait := time.Duration(0)
			if err := label(ctx, client, nodes.GetStore(), slicesInf.GetStore(), opts.Driver); err != nil {
				logger.Error(err, "Cannot label every node with its NVLink domain and clique; retrying")
				wait = retry
			}
			if !sleepOrKick(ctx, kick, wait) {
				return
			}
		}
	}()
	return nil
}

// sleepOrKick waits for a change, or d if d is set (a retry); false when
// ctx ends.
func sleepOrKick(ctx context.Context, kick <-chan struct{}, d time.Duration) bool {
	var after <-chan time.Time
	if d > 0 {
		t := time.NewTimer(d)
		defer t.Stop()
		after = t.C
	}
	select {
	case <-ctx.Done():
		return false
	case <-kick:
		return true
	case <-after:
		return true
	}
}

// label patches every node whose labels differ from Want.
func label(ctx context.Context, client kubernetes.Interface, nodes, resourceSlices cache.Store, driver string) error {
	var sl []*resourceapi.ResourceSlice
	for _, o := range resourceSlices.List() {
		if s, ok := o.(*resourceapi.ResourceSlice); ok {
			sl = append(sl, s)
		}
	}
	want := Want(sl, driver)
	var errs []error
	for _, o := range nodes.List() {
		n, ok := o.(*v1.Node)
		if !ok || n.DeletionTimestamp != nil {
			continue
		}
		patch := Patch(n, want[n.Name])
		if patch == nil {
			continue
		}
		if _, err := client.CoreV1().Nodes().Patch(ctx, n.Name, types.MergePatchType, patch, metav1.PatchOptions{FieldManager: "tessera-controller"}); err != nil {
			errs = append(errs, fmt.Errorf("label node %s: %w", n.Name, err))
			continue
		}
		klog.FromContext(ctx).V(2).Info("Labelled node with its NVLink domain and clique", "node", klog.KObj(n), "labels", want[n.Name])
	}
	if len(errs) > 0 {
		return fmt.Errorf("%d nodes: %w", len(errs), errs[0])
	}
	return nil
}
