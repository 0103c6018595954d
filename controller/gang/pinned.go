package gang

import (
	"context"
	"sort"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/klog/v2"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/driver/simulate"
)

// This file counts what a placement has promised but the scheduler has not
// done yet. Between a member's release (pinned to a node) and the
// scheduler's allocation of its claims, the member's devices and room are
// free in every snapshot; a second gang searched in that window would be
// planned onto them, and both placements would then wait in the scheduler
// for devices only one can get, fail after the grace, and be placed again
// the same way. Each search therefore first takes, in its snapshot, what
// every released, unbound member of another placement will take on its
// node.

// pin is a released member of some gang's placement that the scheduler has
// not bound yet: the node the controller pinned it to, and its own claims
// still to be allocated.
type pin struct {
	pod    *v1.Pod
	node   string
	claims []*resourceapi.ResourceClaim
}

// pinnedNode is the node the controller pinned a released, unbound member
// to ("" for any other pod): a pod with a placement annotation, no gang
// gate, no node yet, not finished, whose required node affinity names one
// node by metadata.name in every term (pinTo).
func pinnedNode(p *v1.Pod) string {
	if p.Spec.NodeName != "" || hasGate(p) || finished(p) || p.Annotations[gangv1.AnnotationPlacement] == "" {
		return ""
	}
	a := p.Spec.Affinity
	if a == nil || a.NodeAffinity == nil || a.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution == nil {
		return ""
	}
	node := ""
	for _, term := range a.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms {
		inTerm := ""
		for _, f := range term.MatchFields {
			if f.Key == "metadata.name" && f.Operator == v1.NodeSelectorOpIn && len(f.Values) == 1 {
				inTerm = f.Values[0]
			}
		}
		if inTerm == "" || node != "" && inTerm != node {
			return ""
		}
		node = inTerm
	}
	return node
}

// pendingPins are the released, unbound members among pods (pinnedNode)
// whose own claims (from the pod's status, as the resourceclaim controller
// names them) are not all allocated yet, with those claims; pods of skip
// are left out (the gang being searched). Sorted by pod, so that every
// search takes them in one order.
func pendingPins(pods []*v1.Pod, claims []*resourceapi.ResourceClaim, skip func(*v1.Pod) bool) []pin {
	byName := map[string]*resourceapi.ResourceClaim{}
	for _, c := range claims {
		byName[c.Namespace+"/"+c.Name] = c
	}
	var out []pin
	for _, p := range pods {
		node := pinnedNode(p)
		if node == "" || skip != nil && skip(p) {
			continue
		}
		pn := pin{pod: p, node: node}
		for _, st := range p.Status.ResourceClaimStatuses {
			if st.ResourceClaimName == nil {
				continue
			}
			c := byName[p.Namespace+"/"+*st.ResourceClaimName]
			if c == nil || c.Status.Allocation != nil || !ownedBy(c, p) {
				continue
			}
			pn.claims = append(pn.claims, c)
		}
		out = append(out, pn)
	}
	sort.Slice(out, func(i, j int) bool {
		return out[i].pod.Namespace+"/"+out[i].pod.Name < out[j].pod.Namespace+"/"+out[j].pod.Name
	})
	return out
}

// ownedBy says whether the claim was made for the pod (from a template).
func ownedBy(c *resourceapi.ResourceClaim, p *v1.Pod) bool {
	for _, ref := range c.OwnerReferences {
		if ref.Kind == "Pod" && ref.UID == p.UID {
			return true
		}
	}
	return false
}

// takePins takes, in cluster, the devices the pins on these nodes will be
// allocated there, as the scheduler would allocate them now: a pin whose
// claims no longer fit its node (the scheduler gave them away) takes
// nothing, and its placement fails on its own; so does one the allocator
// fails on (its claims' selectors are its owner's).
func takePins(ctx context.Context, cluster *simulate.Cluster, pins []pin, nodes map[string]*v1.Node, on []string) {
	in := map[string]bool{}
	for _, n := range on {
		in[n] = true
	}
	for _, pn := range pins {
		node := nodes[pn.node]
		if !in[pn.node] || node == nil || len(pn.claims) == 0 {
			continue
		}
		res, err := allocate(ctx, cluster, node, pn.claims...)
		if err != nil {
			// Another gang's member is no reason to fail this search:
			// it takes nothing, as a pin that no longer fits.
			klog.FromContext(ctx).V(2).Info("Cannot take the devices of another placement's released member; counting it as taking none", "pod", klog.KObj(pn.pod), "node", pn.node, "err", err)
			continue
		}
		cluster.Commit(res...)
	}
}

// has says whether p is one of the view's live members.
func (v *view) has(p *v1.Pod) bool {
	for _, m := range v.live {
		if m.pod.UID == p.UID {
			return true
		}
	}
	return false
}
