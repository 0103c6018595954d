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

// extendedClasses are the extended resources that DeviceClasses back (DRA
// extended resources: a class's extendedResourceName, or
// deviceclass.resource.kubernetes.io/<class>; the README's
// resources.limits gpu.tessera.dev/gpu), each with its class.
// kube-scheduler allocates what a pod asks of them through a claim it
// makes for the pod; yieldToPods fits the same claim (extendedClaim), and
// counts the rest of the pod's requests against the node's room, where
// such a resource has no allocatable.
type extendedClasses map[v1.ResourceName]string

// backedResources are the extended resources the classes back.
func backedResources(classes []*resourceapi.DeviceClass) extendedClasses {
	out := extendedClasses{}
	for _, c := range classes {
		out[v1.ResourceName(resourceapi.ResourceDeviceClassPrefix+c.Name)] = c.Name
		if c.Spec.ExtendedResourceName != nil && *c.Spec.ExtendedResourceName != "" {
			out[v1.ResourceName(*c.Spec.ExtendedResourceName)] = c.Name
		}
	}
	return out
}

// asked is how many devices pod p asks of each class as extended
// resources: the containers' requests, or their limits where a request is
// not given (the API server defaults one to the other for extended
// resources; a pod not defaulted yet asks the same), and an init
// container's where it asks more (it runs alone), as the scheduler counts.
func (b extendedClasses) asked(p *v1.Pod) map[string]int64 {
	var out map[string]int64
	count := func(ctr v1.Container, init bool) {
		for name, class := range b {
			q, ok := ctr.Resources.Requests[name]
			if !ok {
				q, ok = ctr.Resources.Limits[name]
			}
			if !ok || q.Value() <= 0 || (init && q.Value() <= out[class]) {
				continue
			}
			if out == nil {
				out = map[string]int64{}
			}
			if init {
				out[class] = q.Value()
			} else {
				out[class] += q.Value()
			}
		}
	}
	for _, ctr := range p.Spec.Containers {
		count(ctr, false)
	}
	for _, ctr := range p.Spec.InitContainers {
		count(ctr, true)
	}
	return out
}

// without is req less the resources the classes back.
func (b extendedClasses) without(req v1.ResourceList) v1.ResourceList {
	rest := v1.ResourceList{}
	for name, q := range req {
		if _, ok := b[name]; !ok {
			rest[name] = q
		}
	}
	return rest
}

// extendedClaim is a claim asking what asked found, one request of each
// class's count, as kube-scheduler's claim for the pod asks it. It exists
// only in the simulation.
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
