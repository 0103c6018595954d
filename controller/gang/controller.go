// Package gang places gangs (api/gang/v1alpha1): when every member of a gang
// exists and the whole gang fits in one domain, checked with the scheduler's
// own allocator against the live slices and every allocated claim, it
// allocates the shared domain claim's channel, pins each member to its node
// and releases every scheduling gate together; kube-scheduler allocates each
// member's own claims on its node, and the members bind once all are
// allocated (binding conditions on the channel). A gang that does not fit
// stays gated and holds nothing, or reserves the nodes expected to free up
// first (reserve.go, backfill.go, yield.go). State lives in the API, so a
// restarted controller resumes a committed placement or rolls back an
// unfinished one (see reconcile.go and docs/gang.md).
package gang

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/driver/daemonpod"
	"github.com/tessera-dev/tessera/driver/imex"
)

// Options configure the gang controller.
type Options struct {
	// Driver is the DRA driver name of the GPUs and domains.
	Driver string
	// Resync looks at every gang again this often (a safety net; events
	// drive the work).
	Resync time.Duration
	// Metrics, if set, counts placements.
	Metrics *Metrics
	// UnschedulableGrace is how long a released member may stay
	// unschedulable on its node, or bound but not started while a device of
	// its claims is allocated to another claim too, before the gang is
	// placed again; zero is a minute.
	UnschedulableGrace time.Duration
	// IMEXDaemons says the kubelet plugins run IMEX daemons for NVLink
	// domain claims (their --imex-image): the controller reports them on
	// each gang placed in an NVLink domain (condition IMEXReady).
	IMEXDaemons bool
	// DaemonNamespace is the kubelet plugins' namespace, where their
	// IMEX daemon pods run.
	DaemonNamespace string
	// NoReservations: a gang that must wait reserves nothing (no
	// DeviceTaintRules); it is placed when it fits, as before reservations.
	NoReservations bool
	// Interrupt, for tests only, is asked at each Step*; returning true
	// stops the placement there without rollback, as a crash would, and
	// stops the controller.
	Interrupt func(step string) bool
}

// Controller places gangs. Placements run one at a time, so two gangs never
// race for the same devices inside the controller.
type Controller struct {
	r         *reconciler
	queue     workqueue.TypedRateLimitingInterface[string]
	gangInf   cache.SharedIndexInformer
	synced    []cache.InformerSynced
	broadcast record.EventBroadcaster

	mu      sync.Mutex
	members map[string]gangv1.Members // gang key -> how it picks its pods
	// reserving: gang key -> its reservation, for the pending pods of
	// higher priority that may be given its nodes (yieldToPods), and the
	// pods given one, whose changes it is recomputed around.
	reserving map[string]reserving
	stopped   chan error
}

// New wires the controller to the informer factories (started by the caller
// after New).
func New(ctx context.Context, client kubernetes.Interface, dyn dynamic.Interface, factory informers.SharedInformerFactory, dynFactory dynamicinformer.DynamicSharedInformerFactory, opts Options) (*Controller, error) {
	broadcast := record.NewBroadcaster(record.WithContext(ctx))
	broadcast.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: client.CoreV1().Events("")})
	recorder := broadcast.NewRecorder(scheme.Scheme, v1.EventSource{Component: "tessera-controller"})
	pods := factory.Core().V1().Pods()
	claims := factory.Resource().V1().ResourceClaims()
	nodes := factory.Core().V1().Nodes()
	slices := factory.Resource().V1().ResourceSlices()
	gangs := dynFactory.ForResource(gangv1.GroupVersionResource)
	budgets := factory.Policy().V1().PodDisruptionBudgets()
	rulesServed, err := taintRulesServed(client.Discovery())
	if err != nil {
		return nil, err
	}
	reservations := !opts.NoReservations && rulesServed
	if !opts.NoReservations && !rulesServed {
		klog.FromContext(ctx).Info("The API server does not serve DeviceTaintRules (resource.k8s.io/v1, Kubernetes 1.37): gangs that must wait reserve nothing")
	}
	c := &Controller{
		r: &reconciler{
			client: client, gangs: NewClient(dyn), driver: opts.Driver,
			pods: pods.Lister(), claims: claims.Lister(), nodes: nodes.Lister(),
			recorder: recorder, interrupt: opts.Interrupt, metrics: opts.Metrics,
			unschedulableGrace: cmp.Or(opts.UnschedulableGrace, time.Minute),
			imex:               opts.IMEXDaemons,
			imexNamespace:      opts.DaemonNamespace,
			noReservations:     !reservations,
			budgets:            budgets.Lister(),
		},
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(
			workqueue.NewTypedItemExponentialFailureRateLimiter[string](100*time.Millisecond, 30*time.Second),
			workqueue.TypedRateLimitingQueueConfig[string]{Name: "gangs"}),
		gangInf:   gangs.Informer(),
		broadcast: broadcast,
		members:   map[string]gangv1.Members{},
		reserving: map[string]reserving{},
		stopped:   make(chan error, 1),
	}
	c.r.allGangs = c.cachedGangs
	handlers := []struct {
		inf cache.SharedIndexInformer
		h   cache.ResourceEventHandler
	}{
		{c.gangInf, cache.ResourceEventHandlerFuncs{
			AddFunc:    c.gangChanged,
			UpdateFunc: func(_, o any) { c.gangChanged(o) },
			DeleteFunc: c.gangDeleted,
		}},
		{pods.Informer(), cache.ResourceEventHandlerFuncs{
			AddFunc:    c.podChanged,
			UpdateFunc: func(_, o any) { c.podChanged(o) },
			DeleteFunc: c.podChanged,
		}},
		{claims.Informer(), cache.ResourceEventHandlerFuncs{
			UpdateFunc: func(o, n any) { c.claimChanged(o, n) },
			DeleteFunc: func(o any) { c.claimChanged(o, nil) },
		}},
		{slices.Informer(), cache.ResourceEventHandlerFuncs{
			AddFunc:    func(any) { c.enqueueAll() },
			UpdateFunc: func(any, any) { c.enqueueAll() },
			DeleteFunc: func(any) { c.enqueueAll() },
		}},
		// Only read through its lister (preemption).
		{budgets.Informer(), cache.ResourceEventHandlerFuncs{}},
		{nodes.Informer(), cache.ResourceEventHandlerFuncs{
			AddFunc:    func(any) { c.enqueueAll() },
			DeleteFunc: func(any) { c.enqueueAll() },
		}},
	}
	if rulesServed {
		rules := factory.Resource().V1().DeviceTaintRules()
		if reservations {
			c.r.taintRules = rules.Lister() // the reservations' own rules
		}
		// Placement reads every other rule from the API server (List); a
		// change to one (a drain ending) may let a waiting gang fit.
		changed := func(obj any) {
			if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = d.Obj
			}
			if rule, ok := obj.(*resourceapi.DeviceTaintRule); !ok || !reservationRule(rule) {
				c.enqueueAll()
			}
		}
		handlers = append(handlers, struct {
			inf cache.SharedIndexInformer
			h   cache.ResourceEventHandler
		}{rules.Informer(), cache.ResourceEventHandlerFuncs{
			AddFunc:    changed,
			UpdateFunc: func(_, o any) { changed(o) },
			DeleteFunc: changed,
		}})
	}
	for _, h := range handlers {
		reg, err := h.inf.AddEventHandlerWithResyncPeriod(h.h, opts.Resync)
		if err != nil {
			return nil, fmt.Errorf("watch: %w", err)
		}
		c.synced = append(c.synced, reg.HasSynced)
	}
	return c, nil
}

// Run places gangs until ctx ends (or an Interrupt hook fires: then it
// returns errInterrupted's cause).
func (c *Controller) Run(ctx context.Context) error {
	logger := klog.FromContext(ctx)
	defer c.broadcast.Shutdown()
	defer c.queue.ShutDown()
	if !cache.WaitForCacheSync(ctx.Done(), c.synced...) {
		return ctx.Err()
	}
	defer c.r.metrics.watch(c.gangInf.GetStore().List)()
	if err := c.sweepReservationRules(ctx); err != nil {
		// Not fatal: the rules of live gangs are kept right by their
		// reconciles; only a deleted gang's may stay, until the next start.
		logger.Error(err, "Could not delete the reservation rules of gangs that are gone")
	}
	logger.Info("Gang controller started")
	go func() {
		for c.work(ctx) {
		}
	}()
	select {
	case <-ctx.Done():
		return nil
	case err := <-c.stopped:
		return err
	}
}

func (c *Controller) work(ctx context.Context) bool {
	key, quit := c.queue.Get()
	if quit {
		return false
	}
	defer c.queue.Done(key)
	if key == sweepRulesKey {
		if err := c.sweepReservationRules(ctx); err != nil {
			klog.FromContext(ctx).Error(err, "Could not delete the reservation rules of gangs that are gone; retrying")
			c.queue.AddRateLimited(key)
			return true
		}
		c.queue.Forget(key)
		return true
	}
	ns, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil {
		c.queue.Forget(key)
		return true
	}
	res, err := c.r.reconcile(ctx, ns, name)
	if err == errInterrupted {
		c.stopped <- err
		return false
	}
	if err != nil {
		klog.FromContext(ctx).Error(err, "Reconciling gang failed; retrying", "gang", key)
		c.queue.AddRateLimited(key)
		return true
	}
	c.queue.Forget(key)
	if res.requeueAfter > 0 {
		c.queue.AddAfter(key, res.requeueAfter)
	}
	return true
}

func (c *Controller) gangChanged(obj any) {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	u, ok := obj.(*unstructured.Unstructured)
	if !ok {
		return
	}
	key := u.GetNamespace() + "/" + u.GetName()
	if g, err := FromUnstructured(u); err == nil {
		c.mu.Lock()
		if m, err := gangv1.Validate(g); err == nil {
			c.members[key] = m
		}
		if res := g.Status.Reservation; res != nil && g.DeletionTimestamp == nil {
			c.reserving[key] = reservingOf(res)
		} else {
			delete(c.reserving, key)
		}
		c.mu.Unlock()
	}
	c.queue.Add(key)
}

// sweepRulesKey is the queue key of a sweep of the reservation rules whose
// gang is gone; no gang's namespace/name key can contain a space.
const sweepRulesKey = "sweep reservation rules"

// gangDeleted forgets the gang's members and queues a sweep of its
// reservation rules. A DeviceTaintRule is cluster-scoped and a Gang is
// namespaced, so the garbage collector cannot own the rules by the gang;
// the controller deletes them as soon as it sees the gang go, whether or not
// its finalizer ran (removed by hand, or the gang deleted in a way that
// skipped it). The sweep runs on the one worker, after any reconcile that
// read the gang before it went, so a rule such a reconcile wrote is swept
// too.
func (c *Controller) gangDeleted(obj any) {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	if u, ok := obj.(*unstructured.Unstructured); ok {
		c.mu.Lock()
		delete(c.members, u.GetNamespace()+"/"+u.GetName())
		delete(c.reserving, u.GetNamespace()+"/"+u.GetName())
		c.mu.Unlock()
	}
	c.queue.Add(sweepRulesKey)
}

// podChanged enqueues the gangs the pod is a member of.
func (c *Controller) podChanged(obj any) {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	p, ok := obj.(*v1.Pod)
	if !ok {
		return
	}
	if p.Labels[daemonpod.LabelApp] == imex.AppName {
		c.imexChanged(p)
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for key, m := range c.members {
		if ns, _, _ := cache.SplitMetaNamespaceKey(key); ns == p.Namespace && m.Matches(p) {
			c.queue.Add(key)
		}
	}
	// A pod the scheduler could not place may be given the nodes of a
	// reservation of lower priority; a reservation that gave a pod a node
	// is recomputed when the pod changes (placed: around the devices it
	// took; gone: the node is reserved again).
	key := p.Namespace + "/" + p.Name
	for gang, res := range c.reserving {
		if slices.Contains(res.yields, key) || (p.Spec.NodeName == "" && unschedulable(p) && podPriority(p) > res.priority) {
			c.queue.Add(gang)
		}
	}
}

// reserving is what the controller keeps of a gang's reservation between
// looks.
type reserving struct {
	priority int32
	// yields are the pods it left nodes to ("<namespace>/<name>").
	yields []string
}

// reservingOf keeps what podChanged needs of a reservation.
func reservingOf(res *gangv1.Reservation) reserving {
	out := reserving{priority: res.Priority}
	for _, y := range res.Yields {
		out.yields = append(out.yields, y.Pod)
	}
	return out
}

// claimChanged enqueues the claim's gang, and every gang when devices were
// freed (a waiting gang may fit now).
func (c *Controller) claimChanged(oldObj, newObj any) {
	if d, ok := oldObj.(cache.DeletedFinalStateUnknown); ok {
		oldObj = d.Obj
	}
	old, _ := oldObj.(*resourceapi.ResourceClaim)
	cur, _ := newObj.(*resourceapi.ResourceClaim)
	if old == nil {
		return
	}
	if old.Status.Allocation != nil && (cur == nil || cur.Status.Allocation == nil) {
		c.enqueueAll()
		return
	}
	if g := old.Annotations[gangv1.AnnotationGang]; g != "" {
		c.queue.Add(g)
	}
}

// cachedGangs are the gangs in the informer's cache (those that do not
// decode are left out).
func (c *Controller) cachedGangs() []*gangv1.Gang {
	var out []*gangv1.Gang
	for _, o := range c.gangInf.GetStore().List() {
		if u, ok := o.(*unstructured.Unstructured); ok {
			if g, err := FromUnstructured(u); err == nil {
				out = append(out, g)
			}
		}
	}
	return out
}

func (c *Controller) enqueueAll() {
	for _, o := range c.gangInf.GetStore().List() {
		if u, ok := o.(*unstructured.Unstructured); ok {
			c.queue.Add(u.GetNamespace() + "/" + u.GetName())
		}
	}
}

// taintRulesServed says whether the API server serves DeviceTaintRules in
// resource.k8s.io/v1 (Kubernetes 1.37 and later), which reservations write.
func taintRulesServed(d discovery.DiscoveryInterface) (bool, error) {
	list, err := d.ServerResourcesForGroupVersion(resourceapi.SchemeGroupVersion.String())
	switch {
	case apierrors.IsNotFound(err):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("discover %s: %w", resourceapi.SchemeGroupVersion, err)
	}
	for _, r := range list.APIResources {
		if r.Name == "devicetaintrules" {
			return true, nil
		}
	}
	return false, nil
}

// sweepReservationRules deletes the reservation rules whose gang is gone:
// a gang whose finalizer was removed by hand, or deleted while the
// controller was uninstalled, would otherwise leave its nodes reserved.
func (c *Controller) sweepReservationRules(ctx context.Context) error {
	if c.r.taintRules == nil {
		return nil
	}
	uids := map[string]bool{}
	for _, g := range c.cachedGangs() {
		uids[string(g.UID)] = true
	}
	// From the API server, not the cache: a rule the last reconcile wrote
	// may not have reached the lister yet.
	rules, err := c.r.client.ResourceV1().DeviceTaintRules().List(ctx, metav1.ListOptions{LabelSelector: gangv1.LabelReservation})
	if err != nil {
		return fmt.Errorf("list reservation rules: %w", err)
	}
	var errs []error
	for _, rule := range rules.Items {
		if uids[rule.Labels[gangv1.LabelReservation]] {
			continue
		}
		err := c.r.client.ResourceV1().DeviceTaintRules().Delete(ctx, rule.Name, metav1.DeleteOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			errs = append(errs, fmt.Errorf("delete reservation rule %s: %w", rule.Name, err))
			continue
		}
		klog.FromContext(ctx).Info("Deleted the reservation rule of a gang that is gone", "rule", rule.Name)
	}
	return errors.Join(errs...)
}
