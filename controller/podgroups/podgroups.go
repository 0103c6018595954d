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

	resourceapi "k8s.io/api/resource/v1"
	schedulingv1beta1 "k8s.io/api/scheduling/v1beta1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/informers"
	resourcelisters "k8s.io/client-go/listers/resource/v1"
	schedulinglisters "k8s.io/client-go/listers/scheduling/v1beta1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
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
	list, err := d.ServerResourcesForGroupVersion(GroupVersion.String())
	switch {
	case apierrors.IsNotFound(err):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("discover %s: %w", GroupVersion, err)
	}
	for _, r := range list.APIResources {
		if r.Name == "podgroups" {
			return true, nil
		}
	}
	return false, nil
}

// Start watches PodGroups through factory (started by the caller after
// Start) and keeps their Gangs until ctx ends.
func Start(ctx context.Context, dyn dynamic.Interface, factory informers.SharedInformerFactory) error {
	a := &adopter{
		gangs: gang.NewClient(dyn),
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(
			workqueue.NewTypedItemExponentialFailureRateLimiter[string](100*time.Millisecond, 30*time.Second),
			workqueue.TypedRateLimitingQueueConfig[string]{Name: "podgroups"}),
	}
	groups := factory.Scheduling().V1beta1().PodGroups()
	claims := factory.Resource().V1().ResourceClaims()
	a.groups, a.claims = groups.Lister(), claims.Lister()
	var synced []cache.InformerSynced
	for _, h := range []struct {
		inf cache.SharedIndexInformer
		fn  func(any)
	}{
		{groups.Informer(), a.enqueue},
		// A group's template claim appears after the PodGroup names it.
		{claims.Informer(), a.enqueueOwner},
	} {
		reg, err := h.inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
			AddFunc:    h.fn,
			UpdateFunc: func(_, o any) { h.fn(o) },
		})
		if err != nil {
			return fmt.Errorf("watch PodGroups: %w", err)
		}
		synced = append(synced, reg.HasSynced)
	}
	go func() {
		defer a.queue.ShutDown()
		<-ctx.Done()
	}()
	go func() {
		if !cache.WaitForCacheSync(ctx.Done(), synced...) {
			return
		}
		klog.FromContext(ctx).Info("PodGroups with a gang policy and a domain claim are placed as gangs", "api", GroupVersion)
		for a.work(ctx) {
		}
	}()
	return nil
}

// adopter keeps one Gang per PodGroup it places.
type adopter struct {
	gangs  gang.Client
	groups schedulinglisters.PodGroupLister
	claims resourcelisters.ResourceClaimLister
	queue  workqueue.TypedRateLimitingInterface[string]
}

func (a *adopter) enqueue(obj any) {
	if key, err := cache.MetaNamespaceKeyFunc(obj); err == nil {
		a.queue.Add(key)
	}
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

func (a *adopter) work(ctx context.Context) bool {
	key, quit := a.queue.Get()
	if quit {
		return false
	}
	defer a.queue.Done(key)
	again, err := a.sync(ctx, key)
	if err != nil {
		klog.FromContext(ctx).Error(err, "Keeping the gang of a PodGroup failed; retrying", "podGroup", key)
		a.queue.AddRateLimited(key)
		return true
	}
	a.queue.Forget(key)
	if again > 0 {
		a.queue.AddAfter(key, again)
	}
	return true
}

// replacedOwnerWait is how often a PodGroup whose name a Gang of an earlier
// PodGroup of that name still holds looks again: the garbage collector
// removes that Gang shortly.
const replacedOwnerWait = 5 * time.Second

// sync keeps the PodGroup's Gang; again, when set, is when to look again.
func (a *adopter) sync(ctx context.Context, key string) (again time.Duration, _ error) {
	ns, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil {
		return 0, nil
	}
	pg, err := a.groups.PodGroups(ns).Get(name)
	if apierrors.IsNotFound(err) {
		return 0, nil // its gang goes with it (owner reference)
	}
	if err != nil {
		return 0, err
	}
	want, why := Desired(pg, func(ns, name string) (*resourceapi.ResourceClaim, error) {
		return a.claims.ResourceClaims(ns).Get(name)
	})
	logger := klog.LoggerWithValues(klog.FromContext(ctx), "podGroup", klog.KObj(pg))
	if want == nil {
		if why != "" {
			logger.V(2).Info("PodGroup not placed as a gang yet", "reason", why)
		}
		return 0, nil
	}
	have, err := a.gangs.Get(ctx, ns, name)
	switch {
	case apierrors.IsNotFound(err):
		if _, err := a.gangs.Create(ctx, want); err != nil && !apierrors.IsAlreadyExists(err) {
			return 0, fmt.Errorf("create gang for PodGroup %s: %w", key, err)
		}
		logger.Info("Placing the PodGroup as a gang", "size", want.Spec.Size, "domainClaim", want.Spec.DomainClaimName)
		return 0, nil
	case err != nil:
		return 0, err
	case !metav1.IsControlledBy(have, pg):
		if o := metav1.GetControllerOf(have); o != nil && o.Kind == "PodGroup" && o.Name == pg.Name {
			logger.V(2).Info("The Gang of an earlier PodGroup of this name is still there; waiting for the garbage collector")
			return replacedOwnerWait, nil
		}
		logger.Error(errors.New("name taken"), "A Gang of the PodGroup's name exists that the PodGroup does not own; rename one of them to have the PodGroup placed")
		return 0, nil
	case apiequality.Semantic.DeepEqual(have.Spec, want.Spec):
		return 0, nil
	}
	// minCount may change (scaling); the gang follows.
	have.Spec = want.Spec
	if _, err := a.gangs.Update(ctx, have); err != nil {
		return 0, fmt.Errorf("update gang of PodGroup %s: %w", key, err)
	}
	return 0, nil
}

// Desired is the Gang the PodGroup declares, or nil with why not (empty when
// the PodGroup is simply not Tessera's to place).
func Desired(pg *schedulingv1beta1.PodGroup, getClaim func(namespace, name string) (*resourceapi.ResourceClaim, error)) (*gangv1.Gang, string) {
	if pg.DeletionTimestamp != nil || pg.Spec.SchedulingPolicy.Gang == nil {
		return nil, ""
	}
	var domain string
	for i := range pg.Spec.ResourceClaims {
		rc := &pg.Spec.ResourceClaims[i]
		name, _, err := resourceclaim.NameFromPodGroup(pg, rc)
		if err != nil {
			return nil, fmt.Sprintf("group claim %s: %v (the resourceclaim controller creates it from its template)", rc.Name, err)
		}
		if name == nil {
			continue
		}
		c, err := getClaim(pg.Namespace, *name)
		if err != nil {
			return nil, fmt.Sprintf("group claim %s (%s): %v", rc.Name, *name, err)
		}
		if !isDomainClaim(c) {
			continue
		}
		if domain != "" {
			return nil, fmt.Sprintf("group claims %s and %s are both domain claims; a gang shares one", domain, *name)
		}
		domain = *name
	}
	if domain == "" && pg.Annotations[gangv1.AnnotationManaged] != "true" {
		return nil, ""
	}
	spec := gangv1.GangSpec{Size: pg.Spec.SchedulingPolicy.Gang.MinCount, PodGroupName: pg.Name, DomainClaimName: domain}
	if raw, ok := pg.Annotations[gangv1.AnnotationMaxSize]; ok {
		most, err := strconv.ParseInt(raw, 10, 32)
		if err != nil || int32(most) < spec.Size {
			return nil, fmt.Sprintf("annotation %s=%q: want a number of at least the gang policy's minCount (%d), the most members the elastic gang grows to", gangv1.AnnotationMaxSize, raw, spec.Size)
		}
		spec.MinSize, spec.MaxSize, spec.Size = spec.Size, int32(most), 0
	}
	return &gangv1.Gang{
		ObjectMeta: metav1.ObjectMeta{
			Name:      pg.Name,
			Namespace: pg.Namespace,
			OwnerReferences: []metav1.OwnerReference{{
				APIVersion: GroupVersion.String(), Kind: "PodGroup",
				Name: pg.Name, UID: pg.UID, Controller: ptr.To(true),
			}},
		},
		Spec: spec,
	}, ""
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
