package gang

import (
	"fmt"
	"sort"
	"strings"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	resourcehelper "k8s.io/component-helpers/resource"
)

// capacity is what each node has left for pods: its allocatable resources
// less the requests of the pods bound to it, and its pod slots, counted as
// the scheduler's NodeResourcesFit counts them. A member the controller pins
// to a node without room would stay Pending while holding its devices.
type capacity map[string]v1.ResourceList

// newCapacity counts the nodes' room: what bound pods request, and what
// members the controller released and pinned to a node (pinnedNode) will
// request there once the scheduler binds them, so that no second placement
// is planned into room a first one was promised.
func newCapacity(nodes map[string]*v1.Node, pods []*v1.Pod) capacity {
	c := capacity{}
	for name, n := range nodes {
		c[name] = n.Status.Allocatable.DeepCopy()
		if c[name] == nil {
			c[name] = v1.ResourceList{}
		}
	}
	for _, p := range pods {
		node := p.Spec.NodeName
		if node == "" {
			node = pinnedNode(p)
		}
		if node == "" || finished(p) || c[node] == nil {
			continue
		}
		c.take(node, requests(p))
	}
	return c
}

// requests is what the pod asks of its node, counted as the scheduler does
// (init containers, overhead); computed once per pod and placement.
func requests(p *v1.Pod) v1.ResourceList {
	return resourcehelper.PodRequests(p, resourcehelper.PodResourcesOptions{})
}

// of copies the room of the named nodes, for one tentative placement.
func (c capacity) of(nodes []string) capacity {
	out := capacity{}
	for _, n := range nodes {
		if free, ok := c[n]; ok {
			out[n] = free.DeepCopy()
		}
	}
	return out
}

// fits says what, if anything, the node lacks for a pod of these requests.
func (c capacity) fits(node string, req v1.ResourceList) string {
	free := c[node]
	if pods := free[v1.ResourcePods]; pods.Value() < 1 {
		return "pod slots"
	}
	var short []string
	for name, q := range req {
		if q.IsZero() {
			continue
		}
		if have, ok := free[name]; !ok || have.Cmp(q) < 0 {
			short = append(short, fmt.Sprintf("%s (requests %s, %s free)", name, q.String(), have.String()))
		}
	}
	sort.Strings(short)
	return strings.Join(short, ", ")
}

// take counts a pod of these requests against the node.
func (c capacity) take(node string, req v1.ResourceList) {
	free := c[node]
	for name, q := range req {
		have := free[name]
		have.Sub(q)
		free[name] = have
	}
	pods := free[v1.ResourcePods]
	pods.Sub(*resource.NewQuantity(1, resource.DecimalSI))
	free[v1.ResourcePods] = pods
}
