package gang

import (
	"fmt"
	"maps"
	"slices"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// extendedResources splits what a pending pod asks as extended resources
// that DeviceClasses back (DRA extended resources: a class's
// extendedResourceName, or deviceclass.resource.kubernetes.io/<class>; the
// README's resources.limits gpu.tessera.dev/gpu) from the rest of its
// requests. kube-scheduler allocates those through a claim it makes for
// the pod; yieldToPods fits the same claim (extendedClaim), and counts the
// rest against the node's room, where such a resource has no allocatable.
// Quantities are the containers' requests, or their limits where a request
// is not given (the API server defaults one to the other for extended
// resources; a pod not defaulted yet asks the same).
func extendedResources(p *v1.Pod, req v1.ResourceList, classes []*resourceapi.DeviceClass) (map[string]int64, v1.ResourceList) {
	backing := map[v1.ResourceName]string{} // resource -> class
	for _, c := range classes {
		backing[v1.ResourceName(resourceapi.ResourceDeviceClassPrefix+c.Name)] = c.Name
		if c.Spec.ExtendedResourceName != nil && *c.Spec.ExtendedResourceName != "" {
			backing[v1.ResourceName(*c.Spec.ExtendedResourceName)] = c.Name
		}
	}
	asked := map[string]int64{} // class -> devices
	for _, ctr := range p.Spec.Containers {
		for name, class := range backing {
			q, ok := ctr.Resources.Requests[name]
			if !ok {
				q, ok = ctr.Resources.Limits[name]
			}
			if ok && q.Value() > 0 {
				asked[class] += q.Value()
			}
		}
	}
	// An init container runs alone: the pod needs the most of it and of
	// the containers, as the scheduler counts.
	for _, ctr := range p.Spec.InitContainers {
		for name, class := range backing {
			q, ok := ctr.Resources.Requests[name]
			if !ok {
				q, ok = ctr.Resources.Limits[name]
			}
			if ok && q.Value() > asked[class] {
				asked[class] = q.Value()
			}
		}
	}
	if len(asked) == 0 {
		return nil, req
	}
	rest := v1.ResourceList{}
	for name, q := range req {
		if _, ok := backing[name]; !ok {
			rest[name] = q
		}
	}
	return asked, rest
}

// extendedClaim is a claim asking what extendedResources found, one request
// of each class's count, as kube-scheduler's claim for the pod asks it.
// It exists only in the simulation.
func extendedClaim(p *v1.Pod, asked map[string]int64) *resourceapi.ResourceClaim {
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{
		Namespace: p.Namespace, Name: p.Name + "-extended-resources", UID: types.UID(string(p.UID) + "-extended-resources"),
	}}
	for i, class := range slices.Sorted(maps.Keys(asked)) {
		c.Spec.Devices.Requests = append(c.Spec.Devices.Requests, resourceapi.DeviceRequest{
			Name:    fmt.Sprintf("container-%d", i),
			Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: class, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: asked[class]},
		})
	}
	return c
}
