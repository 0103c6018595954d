package podgroups

import (
	"context"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	schedulingv1alpha3 "k8s.io/api/scheduling/v1alpha3"
	schedulingv1beta1 "k8s.io/api/scheduling/v1beta1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/discovery"
	resourcelisters "k8s.io/client-go/listers/resource/v1"
	alpha3listers "k8s.io/client-go/listers/scheduling/v1alpha3"
	schedulinglisters "k8s.io/client-go/listers/scheduling/v1beta1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/controller/gang"
)

// CompositeGroupVersion is the API version of CompositePodGroups: in
// Kubernetes 1.37 they are served only in scheduling.k8s.io/v1alpha3, behind
// the alpha CompositePodGroup feature gate.
var CompositeGroupVersion = schedulingv1alpha3.SchemeGroupVersion

// CompositeServed says whether the API server serves CompositePodGroups
// (--feature-gates=CompositePodGroup=true,TopologyAwareWorkloadScheduling=true
// and --runtime-config=scheduling.k8s.io/v1alpha3=true).
func CompositeServed(d discovery.DiscoveryInterface) (bool, error) {
	return served(d, CompositeGroupVersion.String(), "compositepodgroups")
}

// byParent indexes PodGroups and CompositePodGroups by the namespace/name
// of their parent CompositePodGroup.
const byParent = "parent"

func podGroupParent(obj any) ([]string, error) {
	pg, ok := obj.(*schedulingv1beta1.PodGroup)
	if !ok || pg.Spec.ParentCompositePodGroupName == nil {
		return nil, nil
	}
	return []string{pg.Namespace + "/" + *pg.Spec.ParentCompositePodGroupName}, nil
}

func compositeParent(obj any) ([]string, error) {
	cpg, ok := obj.(*schedulingv1alpha3.CompositePodGroup)
	if !ok || cpg.Spec.ParentCompositePodGroupName == nil {
		return nil, nil
	}
	return []string{cpg.Namespace + "/" + *cpg.Spec.ParentCompositePodGroupName}, nil
}

// parentSays is how a PodGroup's parent CompositePodGroup decides its
// placement.
type parentSays int

const (
	// alone: it has no parent, or a parent with a basic policy; it is
	// placed as any PodGroup.
	alone parentSays = iota
	// asRole: its parent has a gang policy; it is one role of the
	// parent's gang and has no gang of its own.
	asRole
	// waitForParent: its parent is not known yet.
	waitForParent
)

// parentOf says how PodGroup pg's parent decides its placement, and why.
func (a *adopter) parentOf(pg *schedulingv1beta1.PodGroup) (parentSays, string) {
	if pg.Spec.ParentCompositePodGroupName == nil || a.composites == nil {
		return alone, ""
	}
	parent := *pg.Spec.ParentCompositePodGroupName
	cpg, err := a.composites.CompositePodGroups(pg.Namespace).Get(parent)
	switch {
	case apierrors.IsNotFound(err):
		return waitForParent, fmt.Sprintf("its CompositePodGroup %s does not exist yet", parent)
	case err != nil:
		return waitForParent, fmt.Sprintf("its CompositePodGroup %s: %v", parent, err)
	case cpg.Spec.SchedulingPolicy.Gang != nil:
		return asRole, fmt.Sprintf("it is a role of the gang of CompositePodGroup %s", parent)
	}
	return alone, ""
}

// enqueueChildren makes the PodGroups whose parent is the CompositePodGroup
// obj look again.
func (a *adopter) enqueueChildren(groups cache.Indexer) func(any) {
	return func(obj any) {
		cpg, ok := obj.(*schedulingv1alpha3.CompositePodGroup)
		if !ok {
			return
		}
		children, _ := groups.ByIndex(byParent, cpg.Namespace+"/"+cpg.Name)
		for _, c := range children {
			a.enqueue(c)
		}
	}
}

// composer keeps one Gang per CompositePodGroup it places.
type composer struct {
	*loop
	gangs          gang.Client
	composites     alpha3listers.CompositePodGroupLister
	compositeIndex cache.Indexer
	groups         schedulinglisters.PodGroupLister
	groupIndex     cache.Indexer
	claims         resourcelisters.ResourceClaimLister
	workloads      schedulinglisters.WorkloadLister
}

// enqueueParent makes the parent of PodGroup obj look again.
func (c *composer) enqueueParent(obj any) {
	if pg, ok := obj.(*schedulingv1beta1.PodGroup); ok && pg.Spec.ParentCompositePodGroupName != nil {
		c.queue.Add(pg.Namespace + "/" + *pg.Spec.ParentCompositePodGroupName)
	}
}

// enqueueCompositeParent makes the parent of CompositePodGroup obj look
// again: a nested child keeps it from being placed.
func (c *composer) enqueueCompositeParent(obj any) {
	if cpg, ok := obj.(*schedulingv1alpha3.CompositePodGroup); ok && cpg.Spec.ParentCompositePodGroupName != nil {
		c.queue.Add(cpg.Namespace + "/" + *cpg.Spec.ParentCompositePodGroupName)
	}
}

// enqueueClaim makes the CompositePodGroups a domain claim may concern look
// again: the parent of the PodGroup that owns it, or, for a claim the
// children name (resourceClaimName, which may be created after them), every
// CompositePodGroup of its namespace. Only a claim's creation and deletion
// matter (its spec, which says whether it is a domain claim, is
// immutable), so its updates, the allocations and reservations of every
// placement, are not handled.
func (c *composer) enqueueClaim(obj any) {
	cl, ok := obj.(*resourceapi.ResourceClaim)
	if !ok || !isDomainClaim(cl) {
		return
	}
	if o := metav1.GetControllerOf(cl); o != nil && o.Kind == "PodGroup" {
		if pg, err := c.groups.PodGroups(cl.Namespace).Get(o.Name); err == nil {
			c.enqueueParent(pg)
		}
		return
	}
	cpgs, _ := c.composites.CompositePodGroups(cl.Namespace).List(labels.Everything())
	for _, cpg := range cpgs {
		c.enqueue(cpg)
	}
}

// enqueueWorkload makes the CompositePodGroups of Workload obj look again:
// their roles' order is its templates'.
func (c *composer) enqueueWorkload(obj any) {
	w, ok := obj.(*schedulingv1beta1.Workload)
	if !ok {
		return
	}
	cpgs, _ := c.composites.CompositePodGroups(w.Namespace).List(labels.Everything())
	for _, cpg := range cpgs {
		if cpg.Spec.WorkloadRef != nil && cpg.Spec.WorkloadRef.WorkloadName == w.Name {
			c.enqueue(cpg)
		}
	}
}

// sync keeps the CompositePodGroup's Gang.
func (c *composer) sync(ctx context.Context, key string) (time.Duration, error) {
	ns, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil {
		return 0, nil
	}
	cpg, err := c.composites.CompositePodGroups(ns).Get(name)
	if apierrors.IsNotFound(err) {
		c.say(nil, key, "")
		return 0, nil // its gang goes with it (owner reference)
	}
	if err != nil {
		return 0, err
	}
	var children []*schedulingv1beta1.PodGroup
	objs, _ := c.groupIndex.ByIndex(byParent, key)
	for _, o := range objs {
		children = append(children, o.(*schedulingv1beta1.PodGroup))
	}
	var nested []string
	objs, _ = c.compositeIndex.ByIndex(byParent, key)
	for _, o := range objs {
		nested = append(nested, o.(*schedulingv1alpha3.CompositePodGroup).Name)
	}
	want, why := DesiredComposite(cpg, children, nested, Lookups{
		Claim: func(ns, name string) (*resourceapi.ResourceClaim, error) {
			return c.claims.ResourceClaims(ns).Get(name)
		},
		Workload: func(ns, name string) (*schedulingv1beta1.Workload, error) {
			return c.workloads.Workloads(ns).Get(name)
		},
	})
	logger := klog.LoggerWithValues(klog.FromContext(ctx), "compositePodGroup", klog.KObj(cpg))
	if want == nil {
		if why != "" {
			logger.V(2).Info("CompositePodGroup not placed as a gang yet", "reason", why)
		}
		c.say(cpg, key, why)
		return 0, nil
	}
	// A child placed alone before (where CompositePodGroups were not
	// served, or under a basic parent of this name) keeps its gang: the
	// parent's waits for it to go, so that no pod is a member of two.
	for _, r := range want.Spec.Roles {
		own, err := c.gangs.Get(ctx, ns, r.PodGroupName)
		switch {
		case apierrors.IsNotFound(err):
		case err != nil:
			return 0, err
		case own.Name == want.Name && metav1.IsControlledBy(own, cpg):
		default:
			if o := metav1.GetControllerOf(own); o != nil && o.Kind == "PodGroup" && o.Name == r.PodGroupName {
				why := fmt.Sprintf("child PodGroup %s still has the gang %s it was placed alone with: delete that Gang to have the CompositePodGroup placed", r.PodGroupName, own.Name)
				logger.Info("Not placing the CompositePodGroup: " + why)
				c.say(cpg, key, why)
				return takenNameWait, nil
			}
		}
	}
	again, why, err := keep(ctx, c.gangs, logger, cpg, want)
	c.say(cpg, key, why)
	return again, err
}

// DesiredComposite is the Gang a CompositePodGroup with a gang policy
// declares over its child PodGroups, or nil with why not (empty when it is
// simply not Tessera's to place). Each child is one role of the gang, named
// after it, of its minCount members (elastic up to its
// gang.tessera.dev/max-size). The roles follow the order of the children's
// templates in the Workload's CompositePodGroup template (children of one
// template by name), so the last template's pods are evicted first and the
// first's last. The gang's domain claim is the domain claim the children
// name (all the same one: resourceClaimName); without one the
// CompositePodGroup is placed when annotated gang.tessera.dev/managed:
// "true". The gang is placed once minGroupCount children exist, and then
// takes every child, all or nothing. Nested CompositePodGroups are left to
// the scheduler.
func DesiredComposite(cpg *schedulingv1alpha3.CompositePodGroup, children []*schedulingv1beta1.PodGroup, nested []string, look Lookups) (*gangv1.Gang, string) {
	if cpg.DeletionTimestamp != nil || cpg.Spec.SchedulingPolicy.Gang == nil {
		return nil, ""
	}
	var live []*schedulingv1beta1.PodGroup
	for _, pg := range children {
		if pg.DeletionTimestamp == nil {
			live = append(live, pg)
		}
	}
	var domain, domainOf, without string
	for _, pg := range live {
		d, why := domainClaimOf(pg, look.Claim)
		switch {
		case why != "":
			return nil, fmt.Sprintf("child PodGroup %s: %s", pg.Name, why)
		case d == "":
			without = pg.Name
		case d == domain:
		case domain == "":
			domain, domainOf = d, pg.Name
		default:
			return nil, fmt.Sprintf("child PodGroups %s and %s name different domain claims (%s and %s); the groups of one gang share one: give every child the same claim (resourceClaimName)", domainOf, pg.Name, domain, d)
		}
	}
	switch {
	case domain == "" && cpg.Annotations[gangv1.AnnotationManaged] != "true":
		return nil, ""
	case domain != "" && without != "":
		return nil, fmt.Sprintf("child PodGroup %s names no domain claim where %s names %s: every member of a gang shares its domain claim; list %s in %s's resourceClaims and its pods'", without, domainOf, domain, domain, without)
	}
	switch least := int(cpg.Spec.SchedulingPolicy.Gang.MinGroupCount); {
	case cpg.Spec.ParentCompositePodGroupName != nil:
		return nil, fmt.Sprintf("it is a child of CompositePodGroup %s: Tessera places a root CompositePodGroup whose children are PodGroups, and leaves nested ones to the scheduler", *cpg.Spec.ParentCompositePodGroupName)
	case len(nested) > 0:
		return nil, fmt.Sprintf("its children include CompositePodGroups (%s): Tessera places a CompositePodGroup whose children are PodGroups, and leaves nested ones to the scheduler", strings.Join(nested, ", "))
	case len(live) < least:
		return nil, fmt.Sprintf("%d child PodGroups exist, the gang policy's minGroupCount is %d", len(live), least)
	case len(live) > gangv1.MaxRoles:
		return nil, fmt.Sprintf("%d child PodGroups: a gang has at most %d roles", len(live), gangv1.MaxRoles)
	}
	order, why := templateOrder(cpg, look.Workload)
	if why != "" {
		return nil, why
	}
	for _, pg := range live {
		ref := ptr.Deref(pg.Spec.WorkloadRef, schedulingv1beta1.WorkloadReference{})
		if _, ok := order[ref.TemplateName]; !ok || ref.WorkloadName != cpg.Spec.WorkloadRef.WorkloadName {
			return nil, fmt.Sprintf("child PodGroup %s: its workloadRef (Workload %q, template %q) is not a podGroupTemplate of Workload %s's compositePodGroupTemplate %s", pg.Name, ref.WorkloadName, ref.TemplateName, cpg.Spec.WorkloadRef.WorkloadName, cpg.Spec.WorkloadRef.TemplateName)
		}
	}
	slices.SortFunc(live, func(a, b *schedulingv1beta1.PodGroup) int {
		if d := order[a.Spec.WorkloadRef.TemplateName] - order[b.Spec.WorkloadRef.TemplateName]; d != 0 {
			return d
		}
		return strings.Compare(a.Name, b.Name)
	})
	spec := gangv1.GangSpec{CompositePodGroupName: cpg.Name, DomainClaimName: domain}
	for _, pg := range live {
		if pg.Spec.SchedulingPolicy.Gang == nil {
			return nil, fmt.Sprintf("child PodGroup %s has no gang policy: its role's size is its schedulingPolicy.gang.minCount", pg.Name)
		}
		if errs := validation.IsDNS1123Label(pg.Name); len(errs) > 0 {
			return nil, fmt.Sprintf("child PodGroup %s: its name is its role's name, which must be a DNS label: %s", pg.Name, errs[0])
		}
		least, most, why := sizeOf(pg)
		if why != "" {
			return nil, why
		}
		r := gangv1.Role{Name: pg.Name, Size: most, PodGroupName: pg.Name}
		if least < most {
			r.MinSize = least
		}
		if int64(spec.Size)+int64(most) > math.MaxInt32 {
			return nil, fmt.Sprintf("the child PodGroups' sizes add up to more than %d members", math.MaxInt32)
		}
		spec.Size += most
		spec.Roles = append(spec.Roles, r)
	}
	return ownedGang(cpg, "CompositePodGroup", CompositeGroupVersion.String(), spec), ""
}

// Lookups read what DesiredComposite needs besides the CompositePodGroup and
// its children: claims, and the Workload whose template made them.
type Lookups struct {
	Claim    claimGetter
	Workload func(namespace, name string) (*schedulingv1beta1.Workload, error)
}

// templateOrder is the position of each podGroupTemplate in the
// CompositePodGroup template cpg was made from (its workloadRef), or why it
// cannot be read.
func templateOrder(cpg *schedulingv1alpha3.CompositePodGroup, getWorkload func(namespace, name string) (*schedulingv1beta1.Workload, error)) (map[string]int, string) {
	ref := cpg.Spec.WorkloadRef
	if ref == nil {
		return nil, "it has no workloadRef: its roles are ordered by its Workload's templates"
	}
	w, err := getWorkload(cpg.Namespace, ref.WorkloadName)
	if err != nil {
		return nil, fmt.Sprintf("its Workload %s: %v (its roles are ordered by the Workload's templates)", ref.WorkloadName, err)
	}
	for _, t := range w.Spec.CompositePodGroupTemplates {
		if t.Name != ref.TemplateName {
			continue
		}
		order := map[string]int{}
		for i, pt := range t.PodGroupTemplates {
			order[pt.Name] = i
		}
		return order, ""
	}
	return nil, fmt.Sprintf("Workload %s has no compositePodGroupTemplate %s", ref.WorkloadName, ref.TemplateName)
}
