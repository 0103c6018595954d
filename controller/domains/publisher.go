package domains

import (
	"context"
	"fmt"
	"reflect"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2"
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
	// Without an owner the controller manages the driver's slices that name
	// no node: exactly the domain pools (the kubelet plugins' name their node).
	syncDelay := 5 * time.Second
	ctrl, err := resourceslice.StartController(ctx, resourceslice.Options{
		DriverName: opts.Driver, KubeClient: client, SyncDelay: &syncDelay,
	})
	if err != nil {
		return nil, fmt.Errorf("start the domain pool publisher: %w", err)
	}
	p.ctrl = ctrl
	go p.run(ctx)
	return p, nil
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
