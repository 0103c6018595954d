package domains

import (
	"context"
	"fmt"
	"reflect"
	"slices"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/retry"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	"github.com/tessera-dev/tessera/driver/domain"
)

// Options configure the publisher.
type Options struct {
	// Driver is the DRA driver name (the domain pools' and the GPUs').
	Driver string
	// TopologyKey is the node label whose values are domains; empty for
	// NVLink cliques only.
	TopologyKey string
	// Channels is how many channel devices (gangs at once) a domain offers.
	Channels int
	// Owner is the cluster-scoped object (Tessera's domain DeviceClass) that
	// owns the domain pools' slices: the garbage collector deletes them with
	// it, as when the chart is uninstalled. Slices published without it
	// (by an earlier version) are adopted at start. Nil: no owner, and the
	// slices stay until deleted by hand.
	Owner *resourceslice.Owner
}

// Publisher keeps the domain pools in step with the nodes and their slices.
type Publisher struct {
	opts   Options
	nodes  cache.SharedIndexInformer
	slices cache.SharedIndexInformer
	ctrl   *resourceslice.Controller
	kick   chan struct{}
}

// Start publishes the domains found in the informers' nodes and slices, and
// again whenever they change, until ctx ends. The factory must be started by
// the caller.
func Start(ctx context.Context, client kubernetes.Interface, factory informers.SharedInformerFactory, opts Options) (*Publisher, error) {
	if opts.Channels < 1 {
		return nil, fmt.Errorf("domain channels %d: want at least 1", opts.Channels)
	}
	p := &Publisher{
		opts:   opts,
		nodes:  factory.Core().V1().Nodes().Informer(),
		slices: factory.Resource().V1().ResourceSlices().Informer(),
		kick:   make(chan struct{}, 1),
	}
	handler := cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { p.changed() },
		UpdateFunc: func(any, any) { p.changed() },
		DeleteFunc: func(any) { p.changed() },
	}
	for _, inf := range []cache.SharedIndexInformer{p.nodes, p.slices} {
		if _, err := inf.AddEventHandler(handler); err != nil {
			return nil, err
		}
	}
	if opts.Owner != nil {
		if err := adopt(ctx, client, opts.Driver, *opts.Owner); err != nil {
			return nil, err
		}
	}
	// Whatever its owner (unless a Node), the controller manages the
	// driver's slices that name no node: exactly the domain pools (the
	// kubelet plugins' name their node).
	syncDelay := 5 * time.Second
	ctrl, err := resourceslice.StartController(ctx, resourceslice.Options{
		DriverName: opts.Driver, KubeClient: client, SyncDelay: &syncDelay, Owner: opts.Owner,
	})
	if err != nil {
		return nil, fmt.Errorf("start the domain pool publisher: %w", err)
	}
	p.ctrl = ctrl
	go p.run(ctx)
	return p, nil
}

// adopt makes owner the owner of every domain slice of driver that it does
// not own yet (the slices an earlier version published without one, or with
// an owner since replaced), in place of any earlier reference of owner's
// kind and name. A slice it cannot change (after retries on conflicts) is
// logged and left: it only stays after an uninstall, and failing here would
// stop the controller from placing any gang.
func adopt(ctx context.Context, client kubernetes.Interface, driver string, owner resourceslice.Owner) error {
	logger := klog.FromContext(ctx)
	list, err := client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{
		FieldSelector: fields.Set{resourceapi.ResourceSliceSelectorDriver: driver, resourceapi.ResourceSliceSelectorNodeName: ""}.String(),
	})
	if err != nil {
		return fmt.Errorf("list the domain slices to give them their owner: %w", err)
	}
	for i := range list.Items {
		slice := &list.Items[i]
		if !isDomainSlice(slice, driver) || !setOwner(slice.DeepCopy(), owner) {
			continue
		}
		err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
			if !setOwner(slice, owner) {
				return nil
			}
			_, err := client.ResourceV1().ResourceSlices().Update(ctx, slice, metav1.UpdateOptions{})
			if apierrors.IsConflict(err) {
				current, getErr := client.ResourceV1().ResourceSlices().Get(ctx, slice.Name, metav1.GetOptions{})
				if getErr != nil {
					return getErr
				}
				*slice = *current
			}
			return err
		})
		switch {
		case apierrors.IsNotFound(err):
		case err != nil:
			logger.Error(err, "Giving a domain slice its owner failed; it stays after an uninstall unless deleted by hand", "slice", klog.KObj(slice), "owner", owner.Kind+"/"+owner.Name)
		default:
			logger.Info("Adopted a domain slice", "slice", klog.KObj(slice), "pool", slice.Spec.Pool.Name, "owner", owner.Kind+"/"+owner.Name)
		}
	}
	return nil
}

// isDomainSlice says whether slice is one of driver's domain pools'.
func isDomainSlice(slice *resourceapi.ResourceSlice, driver string) bool {
	_, _, ok := domain.ParsePool(slice.Spec.Pool.Name)
	return ok && slice.Spec.Driver == driver && ptr.Deref(slice.Spec.NodeName, "") == ""
}

// setOwner makes owner the slice's only owner of its kind and name, keeping
// other references; it is the slice's controller unless another reference
// is already. It reports whether the slice changed.
func setOwner(slice *resourceapi.ResourceSlice, owner resourceslice.Owner) bool {
	same := func(r metav1.OwnerReference) bool {
		return r.APIVersion == owner.APIVersion && r.Kind == owner.Kind && r.Name == owner.Name
	}
	refs := slices.DeleteFunc(slices.Clone(slice.OwnerReferences), same)
	if len(refs)+1 == len(slice.OwnerReferences) && slices.ContainsFunc(slice.OwnerReferences, func(r metav1.OwnerReference) bool { return same(r) && r.UID == owner.UID }) {
		return false
	}
	controller := !slices.ContainsFunc(refs, func(r metav1.OwnerReference) bool { return ptr.Deref(r.Controller, false) })
	slice.OwnerReferences = append(refs, metav1.OwnerReference{
		APIVersion: owner.APIVersion, Kind: owner.Kind, Name: owner.Name, UID: owner.UID, Controller: ptr.To(controller),
	})
	return true
}

func (p *Publisher) changed() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// run recomputes the domains on every change (coalesced) and publishes them
// when they differ from what was published.
func (p *Publisher) run(ctx context.Context) {
	logger := klog.FromContext(ctx)
	defer p.ctrl.Stop()
	if !cache.WaitForCacheSync(ctx.Done(), p.nodes.HasSynced, p.slices.HasSynced) {
		return
	}
	var last []Domain
	published := false
	for {
		ds := p.Domains()
		if !published || !reflect.DeepEqual(ds, last) {
			p.ctrl.Update(Resources(ds, p.opts.Channels))
			for _, d := range ds {
				logger.V(2).Info("Publishing domain", "pool", d.Pool(), "kind", d.Kind, "domain", d.Value, "nodes", len(d.Nodes), "gpus", d.GPUs)
			}
			logger.Info("Domains published", "count", len(ds))
			last, published = ds, true
		}
		select {
		case <-ctx.Done():
			return
		case <-p.kick:
			// Coalesce a burst of changes (a node's slices arrive together).
			select {
			case <-ctx.Done():
				return
			case <-time.After(200 * time.Millisecond):
			}
		}
	}
}

// Domains computes the domains from the informers' current content.
func (p *Publisher) Domains() []Domain {
	var nodes []*v1.Node
	for _, o := range p.nodes.GetStore().List() {
		nodes = append(nodes, o.(*v1.Node))
	}
	var sl []*resourceapi.ResourceSlice
	for _, o := range p.slices.GetStore().List() {
		sl = append(sl, o.(*resourceapi.ResourceSlice))
	}
	return Compute(nodes, sl, p.opts.Driver, p.opts.TopologyKey)
}
