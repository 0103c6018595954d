package gang

import (
	"fmt"
	"strings"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/driver/daemonpod"
	"github.com/tessera-dev/tessera/driver/domain"
	"github.com/tessera-dev/tessera/driver/imex"
)

// imexStatus sets the gang's IMEXReady condition when its domain claim is
// allocated in an NVLink domain: true when every node of the placement
// (the claim's gang.tessera.dev/nodes) has its IMEX daemon pod for the
// claim ready, false naming the nodes whose daemon is missing or not ready.
// The kubelet plugins start the daemons while preparing the claim, so a
// member cannot run on a node whose daemon never became ready; this
// condition shows a daemon that failed later, or one still starting.
func (r *reconciler) imexStatus(g *gangv1.Gang, v *view, st *gangv1.GangStatus) {
	c := v.domainClaim
	if c == nil || c.Status.Allocation == nil || !nvlink(c.Status.Allocation.Devices.Results, r.driver) {
		return
	}
	nodes, err := gangv1.ParseNodes(c.Annotations[gangv1.AnnotationNodes])
	if err != nil || len(nodes) == 0 {
		msg := fmt.Sprintf("the domain claim %s/%s does not list the placement's nodes (annotation %s), so no IMEX daemon can be configured", c.Namespace, c.Name, gangv1.AnnotationNodes)
		setCondition(st, g.Generation, gangv1.ConditionIMEXReady, false, gangv1.ReasonIMEXNotReady, msg)
		return
	}
	sel := labels.SelectorFromSet(labels.Set{daemonpod.LabelApp: imex.AppName, daemonpod.LabelClaimUID: string(c.UID)})
	pods, _ := r.pods.List(sel)
	byNode := map[string]*v1.Pod{}
	for _, p := range pods {
		// Only the plugins' daemons count: a pod labelled alike in
		// another namespace is no daemon.
		if p.DeletionTimestamp == nil && p.Namespace == r.imexNamespace {
			byNode[p.Spec.NodeName] = p
		}
	}
	var addresses []string
	for _, n := range nodes {
		addresses = append(addresses, n.Address)
	}
	want := strings.Join(addresses, ",")
	var bad []string
	for _, n := range nodes {
		p := byNode[n.Name]
		switch {
		case p == nil:
			bad = append(bad, n.Name+" (no daemon)")
		case p.Annotations[imex.AnnotationNodes] != want:
			bad = append(bad, fmt.Sprintf("%s (daemon %s/%s configured for %s)", n.Name, p.Namespace, p.Name, p.Annotations[imex.AnnotationNodes]))
		case !podReady(p):
			bad = append(bad, fmt.Sprintf("%s (daemon %s/%s not ready)", n.Name, p.Namespace, p.Name))
		}
	}
	if len(bad) > 0 {
		setCondition(st, g.Generation, gangv1.ConditionIMEXReady, false, gangv1.ReasonIMEXNotReady,
			fmt.Sprintf("IMEX daemons ready on %d of %d nodes; not on %s", len(nodes)-len(bad), len(nodes), strings.Join(bad, ", ")))
		return
	}
	setCondition(st, g.Generation, gangv1.ConditionIMEXReady, true, gangv1.ReasonIMEXReady,
		fmt.Sprintf("IMEX daemons ready on all %d nodes", len(nodes)))
}

// nvlink says whether a result of driver lies in an NVLink domain's pool.
func nvlink(results []resourceapi.DeviceRequestAllocationResult, driver string) bool {
	for _, r := range results {
		if kind, _, ok := domain.ParsePool(r.Pool); ok && kind == domain.KindNVLink && r.Driver == driver {
			return true
		}
	}
	return false
}

func podReady(p *v1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == v1.PodReady {
			return c.Status == v1.ConditionTrue
		}
	}
	return false
}

// imexChanged enqueues the gang of the domain claim an IMEX daemon pod
// serves, so that its IMEXReady condition follows the daemon.
func (c *Controller) imexChanged(p *v1.Pod) {
	ns, name, ok := strings.Cut(p.Annotations[daemonpod.AnnotationClaim], "/")
	if !ok {
		return
	}
	if p.Namespace != c.r.imexNamespace {
		return
	}
	claim, err := c.r.getClaim(ns, name)
	if err != nil || string(claim.UID) != p.Labels[daemonpod.LabelClaimUID] {
		return
	}
	if gang := claim.Annotations[gangv1.AnnotationGang]; gang != "" {
		if _, _, err := cache.SplitMetaNamespaceKey(gang); err == nil {
			c.queue.Add(gang)
		}
	}
}

// imexUnusable are the nodes an NVLink placement of the gang whose domain
// claim is own cannot use for IMEX: the nodes of every other allocated
// NVLink domain claim of driver (their gang.tessera.dev/nodes), each
// running an IMEX daemon for that claim (a node serves one IMEX domain at
// a time: the daemon's port is a host port), and the nodes without an
// InternalIP, where a daemon would have no address to serve on and every
// prepare of the gang would fail.
func imexUnusable(claims []*resourceapi.ResourceClaim, driver string, own types.UID, nodes map[string]*v1.Node) map[string]bool {
	busy := map[string]bool{}
	for name, n := range nodes {
		if internalIP(n) == "" {
			busy[name] = true
		}
	}
	for _, c := range claims {
		if c.UID == own || c.Status.Allocation == nil || !nvlink(c.Status.Allocation.Devices.Results, driver) {
			continue
		}
		nodes, err := gangv1.ParseNodes(c.Annotations[gangv1.AnnotationNodes])
		if err != nil {
			continue
		}
		for _, n := range nodes {
			busy[n.Name] = true
		}
	}
	return busy
}

// withoutIMEXBusy drops the busy nodes from the NVLink domains' candidates.
func withoutIMEXBusy(cands []candidate, busy map[string]bool) []candidate {
	if len(busy) == 0 {
		return cands
	}
	for i, c := range cands {
		if kind, _, ok := domain.ParsePool(c.pool); !ok || kind != domain.KindNVLink {
			continue
		}
		var free []string
		for _, n := range c.nodes {
			if !busy[n] {
				free = append(free, n)
			}
		}
		cands[i].nodes = free
	}
	return cands
}

// internalIP is the node's first InternalIP address ("" when it has none),
// the one placementNodes writes.
func internalIP(n *v1.Node) string {
	for _, a := range n.Status.Addresses {
		if a.Type == v1.NodeInternalIP {
			return a.Address
		}
	}
	return ""
}
