// Package podgroups lets the Kubernetes PodGroup API (scheduling.k8s.io/v1beta1)
// declare Tessera gangs. For each PodGroup with a gang policy whose group
// claims include one of class domain.gpu.tessera.dev (or that is annotated
// gang.tessera.dev/managed: "true"), it keeps a Gang of the same name whose
// members are the PodGroup's pods, whose size is its minCount (an elastic
// gang from minCount to gang.tessera.dev/max-size where the PodGroup carries
// that annotation) and whose domain claim is the group's. The Gang is owned by the PodGroup: the gang
// controller places it like any other, its status and events tell the user
// why it waits, and the garbage collector removes it with the PodGroup. It
// runs only where the API server serves PodGroups.
package podgroups

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	schedulingv1beta1 "k8s.io/api/scheduling/v1beta1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	resourcelisters "k8s.io/client-go/listers/resource/v1"
	alpha3listers "k8s.io/client-go/listers/scheduling/v1alpha3"
	schedulinglisters "k8s.io/client-go/listers/scheduling/v1beta1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/dynamic-resource-allocation/resourceclaim"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/controller/gang"
)

// GroupVersion is the PodGroup API version read: the one kube-scheduler and
// the resourceclaim controller use in Kubernetes 1.37.
var GroupVersion = schedulingv1beta1.SchemeGroupVersion

// Served says whether the API server serves PodGroups (GenericWorkload on,
// --runtime-config=scheduling.k8s.io/v1beta1=true).
func Served(d discovery.DiscoveryInterface) (bool, error) {
	return served(d, GroupVersion.String(), "podgroups")
}

// served says whether the API server serves resource in groupVersion.
func served(d discovery.DiscoveryInterface, groupVersion, resource string) (bool, error) {
	list, err := d.ServerResourcesForGroupVersion(groupVersion)
	switch {
	case apierrors.IsNotFound(err):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("discover %s: %w", groupVersion, err)
	}
	for _, r := range list.APIResources {
		if r.Name == resource {
			return true, nil
		}
	}
	return false, nil
}

// Start watches PodGroups through factory (started by the caller after
// Start) and keeps their Gangs until ctx ends; with composites (the API
// server serves CompositePodGroups: CompositeServed), it keeps the Gangs
// of CompositePodGroups too.
func Start(ctx context.Context, client kubernetes.Interface, dyn dynamic.Interface, factory informers.SharedInformerFactory, composites bool) error {
	broadcast := record.NewBroadcaster(record.WithContext(ctx))
	broadcast.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: client.CoreV1().Events("")})
	go func() {
		<-ctx.Done()
		broadcast.Shutdown()
	}()
	recorder := broadcast.NewRecorder(scheme.Scheme, corev1.EventSource{Component: "tessera-controller"})
	groups := factory.Scheduling().V1beta1().PodGroups()
	claims := factory.Resource().V1().ResourceClaims()
	a := &adopter{gangs: gang.NewClient(dyn), groups: groups.Lister(), claims: claims.Lister()}
	a.loop = newLoop("podgroups", "PodGroup", GroupVersion.String(), a.sync)
	a.recorder = recorder
	loops := []*loop{a.loop}
	handlers := []handler{
		{inf: groups.Informer(), fn: a.enqueue, loop: a.loop},
		// A group's template claim appears after the PodGroup names it.
		{inf: claims.Informer(), fn: a.enqueueOwner, loop: a.loop},
	}
	if composites {
		cpgs := factory.Scheduling().V1alpha3().CompositePodGroups()
		if err := groups.Informer().AddIndexers(cache.Indexers{byParent: podGroupParent}); err != nil {
			return fmt.Errorf("index PodGroups by parent: %w", err)
		}
		if err := cpgs.Informer().AddIndexers(cache.Indexers{byParent: compositeParent}); err != nil {
			return fmt.Errorf("index CompositePodGroups by parent: %w", err)
		}
		a.composites = cpgs.Lister()
		workloads := factory.Scheduling().V1beta1().Workloads()
		c := &composer{gangs: a.gangs, composites: cpgs.Lister(), compositeIndex: cpgs.Informer().GetIndexer(),
			groups: groups.Lister(), groupIndex: groups.Informer().GetIndexer(), claims: claims.Lister(), workloads: workloads.Lister()}
		c.loop = newLoop("compositepodgroups", "CompositePodGroup", CompositeGroupVersion.String(), c.sync)
		c.recorder = recorder
		loops = append(loops, c.loop)
		handlers = append(handlers,
			// A PodGroup that waits for its parent looks again once
			// the parent exists.
			handler{inf: cpgs.Informer(), fn: a.enqueueChildren(groups.Informer().GetIndexer()), loop: a.loop},
			handler{inf: cpgs.Informer(), fn: c.enqueue, loop: c.loop},
			handler{inf: cpgs.Informer(), fn: c.enqueueCompositeParent, loop: c.loop},
			handler{inf: groups.Informer(), fn: c.enqueueParent, loop: c.loop},
			handler{inf: claims.Informer(), fn: c.enqueueClaim, loop: c.loop, noUpdates: true},
			handler{inf: workloads.Informer(), fn: c.enqueueWorkload, loop: c.loop},
		)
	}
	for _, h := range handlers {
		funcs := cache.ResourceEventHandlerFuncs{
			AddFunc: h.fn,
			DeleteFunc: func(o any) {
				if d, ok := o.(cache.DeletedFinalStateUnknown); ok {
					o = d.Obj
				}
				h.fn(o)
			},
		}
		if !h.noUpdates {
			funcs.UpdateFunc = func(_, o any) { h.fn(o) }
		}
		reg, err := h.inf.AddEventHandler(funcs)
		if err != nil {
			return fmt.Errorf("watch %ss: %w", h.loop.kind, err)
		}
		h.loop.synced = append(h.loop.synced, reg.HasSynced)
	}
	for _, l := range loops {
		go func() {
			defer l.queue.ShutDown()
			<-ctx.Done()
		}()
		// Each loop waits for its own informers only: PodGroups are
		// placed even where CompositePodGroups cannot be listed.
		go func() {
			if !cache.WaitForCacheSync(ctx.Done(), l.synced...) {
				return
			}
			klog.FromContext(ctx).Info(l.kind+"s with a gang policy and a domain claim are placed as gangs", "api", l.api)
			for l.work(ctx) {
			}
		}()
	}
	return nil
}

// handler is what one informer's events call, for which loop.
type handler struct {
	inf  cache.SharedIndexInformer
	fn   func(any)
	loop *loop
	// noUpdates: fn is called on additions and deletions only.
	noUpdates bool
}

// adopter keeps one Gang per PodGroup it places.
type adopter struct {
	*loop
	gangs  gang.Client
	groups schedulinglisters.PodGroupLister
	claims resourcelisters.ResourceClaimLister
	// composites, when the API server serves them, tell whether a
	// PodGroup with a parent is a role of its parent's gang.
	composites alpha3listers.CompositePodGroupLister
}

func (a *adopter) enqueueOwner(obj any) {
	c, ok := obj.(*resourceapi.ResourceClaim)
	if !ok {
		return
	}
	if o := metav1.GetControllerOf(c); o != nil && o.Kind == "PodGroup" {
		a.queue.Add(c.Namespace + "/" + o.Name)
	}
}

// replacedOwnerWait is how often a PodGroup whose name a Gang of an earlier
// PodGroup of that name still holds looks again: the garbage collector
// removes that Gang shortly.
const replacedOwnerWait = 5 * time.Second

// takenNameWait is how often a PodGroup or CompositePodGroup whose name a
// Gang of another owner holds looks again: nothing else tells it the name
// is free.
const takenNameWait = time.Minute

// sync keeps the PodGroup's Gang; again, when set, is when to look again.
func (a *adopter) sync(ctx context.Context, key string) (again time.Duration, _ error) {
	ns, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil {
		return 0, nil
	}
	pg, err := a.groups.PodGroups(ns).Get(name)
	if apierrors.IsNotFound(err) {
		a.say(nil, key, "")
		return 0, nil // its gang goes with it (owner reference)
	}
	if err != nil {
		return 0, err
	}
	logger := klog.LoggerWithValues(klog.FromContext(ctx), "podGroup", klog.KObj(pg))
	switch says, why := a.parentOf(pg); says {
	case waitForParent:
		logger.V(2).Info("PodGroup not placed yet", "reason", why)
		a.say(pg, key, why)
		return 0, nil
	case asRole:
		logger.V(2).Info("PodGroup not placed alone", "reason", why)
		a.say(pg, key, "")
		return 0, nil
	}
	want, why := Desired(pg, func(ns, name string) (*resourceapi.ResourceClaim, error) {
		return a.claims.ResourceClaims(ns).Get(name)
	})
	if want == nil {
		if why != "" {
			logger.V(2).Info("PodGroup not placed as a gang yet", "reason", why)
		}
		a.say(pg, key, why)
		return 0, nil
	}
	again, why, err = keep(ctx, a.gangs, logger, pg, want)
	a.say(pg, key, why)
	return again, err
}

// keep makes the Gang want (of owner's name, owned by it) exist as want
// says; again, when set, is when to look again, and why, when set, why the
// owner is not placed.
func keep(ctx context.Context, gangs gang.Client, logger klog.Logger, owner metav1.Object, want *gangv1.Gang) (again time.Duration, why string, _ error) {
	kind := want.OwnerReferences[0].Kind
	have, err := gangs.Get(ctx, want.Namespace, want.Name)
	switch {
	case apierrors.IsNotFound(err):
		got, err := gangs.Create(ctx, want)
		switch {
		case apierrors.IsAlreadyExists(err):
			return 0, "", nil
		case err != nil:
			return 0, "", fmt.Errorf("create gang for %s %s/%s: %w", kind, want.Namespace, want.Name, err)
		}
		logger.Info("Placing the "+kind+" as a gang", "size", want.Spec.Size, "roles", len(want.Spec.Roles), "domainClaim", want.Spec.DomainClaimName)
		return 0, "", pruned(got, want)
	case err != nil:
		return 0, "", err
	case !metav1.IsControlledBy(have, owner):
		if o := metav1.GetControllerOf(have); o != nil && o.Kind == kind && o.Name == owner.GetName() {
			logger.V(2).Info("The Gang of an earlier " + kind + " of this name is still there; waiting for the garbage collector")
			return replacedOwnerWait, "", nil
		}
		why := fmt.Sprintf("a Gang %s exists that this %s does not own: rename one of them to have the %s placed", want.Name, kind, kind)
		logger.Error(errors.New("name taken"), why)
		return takenNameWait, why, nil
	case apiequality.Semantic.DeepEqual(have.Spec, want.Spec):
		return 0, "", nil
	}
	// minCount may change (scaling), and a CompositePodGroup gain
	// children; the gang follows.
	have.Spec = want.Spec
	got, err := gangs.Update(ctx, have)
	if err != nil {
		return 0, "", fmt.Errorf("update gang of %s %s/%s: %w", kind, want.Namespace, want.Name, err)
	}
	return 0, "", pruned(got, want)
}

// pruned says whether the API server dropped fields of want from got, the
// gang it stored: a Gang CRD older than the controller (Helm does not
// upgrade CRDs) prunes the fields it does not know.
func pruned(got, want *gangv1.Gang) error {
	if got.Spec.CompositePodGroupName != want.Spec.CompositePodGroupName || (len(want.Spec.Roles) > 0 && got.Spec.Roles[0].PodGroupName != want.Spec.Roles[0].PodGroupName) {
		return fmt.Errorf("gang %s/%s: the API server dropped spec.compositePodGroupName or spec.roles[].podGroupName: its Gang CRD is older than tessera-controller; apply deployments/crds (or the chart's crds/) again", want.Namespace, want.Name)
	}
	return nil
}

// Desired is the Gang the PodGroup declares, or nil with why not (empty when
// the PodGroup is simply not Tessera's to place). A PodGroup that is a child
// of a CompositePodGroup is placed as one role of its parent's gang
// (DesiredComposite) when the parent has a gang policy: sync does not ask
// Desired of it then.
func Desired(pg *schedulingv1beta1.PodGroup, getClaim claimGetter) (*gangv1.Gang, string) {
	if pg.DeletionTimestamp != nil || pg.Spec.SchedulingPolicy.Gang == nil {
		return nil, ""
	}
	domain, why := domainClaimOf(pg, getClaim)
	if why != "" {
		return nil, why
	}
	if domain == "" && pg.Annotations[gangv1.AnnotationManaged] != "true" {
		return nil, ""
	}
	least, most, why := sizeOf(pg)
	if why != "" {
		return nil, why
	}
	spec := gangv1.GangSpec{Size: least, PodGroupName: pg.Name, DomainClaimName: domain}
	if most != least || pg.Annotations[gangv1.AnnotationMaxSize] != "" {
		spec.MinSize, spec.MaxSize, spec.Size = least, most, 0
	}
	return ownedGang(pg, "PodGroup", GroupVersion.String(), spec), ""
}

// claimGetter looks a claim up by namespace and name.
type claimGetter func(namespace, name string) (*resourceapi.ResourceClaim, error)

// domainClaimOf is the name of the PodGroup's one claim of class
// domain.gpu.tessera.dev ("" when it has none), or why it cannot be told.
func domainClaimOf(pg *schedulingv1beta1.PodGroup, getClaim claimGetter) (domain, why string) {
	for i := range pg.Spec.ResourceClaims {
		rc := &pg.Spec.ResourceClaims[i]
		name, _, err := resourceclaim.NameFromPodGroup(pg, rc)
		if err != nil {
			return "", fmt.Sprintf("group claim %s: %v (the resourceclaim controller creates it from its template)", rc.Name, err)
		}
		if name == nil {
			continue
		}
		c, err := getClaim(pg.Namespace, *name)
		if err != nil {
			return "", fmt.Sprintf("group claim %s (%s): %v", rc.Name, *name, err)
		}
		if !isDomainClaim(c) {
			continue
		}
		if domain != "" {
			return "", fmt.Sprintf("group claims %s and %s are both domain claims; a gang shares one", domain, *name)
		}
		domain = *name
	}
	return domain, ""
}

// sizeOf is how many members a PodGroup with a gang policy has: minCount,
// and up to its gang.tessera.dev/max-size annotation's number.
func sizeOf(pg *schedulingv1beta1.PodGroup) (least, most int32, why string) {
	least = pg.Spec.SchedulingPolicy.Gang.MinCount
	raw, ok := pg.Annotations[gangv1.AnnotationMaxSize]
	if !ok {
		return least, least, ""
	}
	n, err := strconv.ParseInt(raw, 10, 32)
	if err != nil || int32(n) < least {
		return 0, 0, fmt.Sprintf("PodGroup %s: annotation %s=%q: want a number of at least the gang policy's minCount (%d), the most members the elastic gang grows to", pg.Name, gangv1.AnnotationMaxSize, raw, least)
	}
	return least, int32(n), ""
}

// ownedGang is the Gang of spec, named and controlled by owner (of kind and
// apiVersion).
func ownedGang(owner metav1.Object, kind, apiVersion string, spec gangv1.GangSpec) *gangv1.Gang {
	return &gangv1.Gang{
		ObjectMeta: metav1.ObjectMeta{
			Name:      owner.GetName(),
			Namespace: owner.GetNamespace(),
			OwnerReferences: []metav1.OwnerReference{{
				APIVersion: apiVersion, Kind: kind,
				Name: owner.GetName(), UID: owner.GetUID(), Controller: ptr.To(true),
			}},
		},
		Spec: spec,
	}
}

// isDomainClaim says whether the claim asks for a domain device.
func isDomainClaim(c *resourceapi.ResourceClaim) bool {
	for _, r := range c.Spec.Devices.Requests {
		if r.Exactly != nil && r.Exactly.DeviceClassName == gangv1.DomainClass {
			return true
		}
	}
	return false
}
