package gang

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"
	"k8s.io/component-helpers/scheduling/corev1/nodeaffinity"
	"k8s.io/klog/v2"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/driver/domain"
	"github.com/tessera-dev/tessera/driver/simulate"
)

// deleteProtection is the finalizer the scheduler adds to a claim it
// allocates; without it a deleted pod's claim can stay allocated.
const deleteProtection = "resource.kubernetes.io/delete-protection"

// writeParallelism bounds concurrent API writes of one placement.
const writeParallelism = 32

// claimWrite is one claim's part of a placement.
type claimWrite struct {
	claim *resourceapi.ResourceClaim
	// alloc is the allocation the search found: written only when
	// allocate is set; else it is the plan the pre-write check judges.
	alloc resourceapi.AllocationResult
	// allocate is set on the domain claim only: the controller writes its
	// channel's allocation (no one else allocates channels). A member's
	// own claims are only annotated; the scheduler allocates them once the
	// member is released onto its node.
	allocate bool
	// pods the claim is reserved for.
	pods []*v1.Pod
	// annotations to set besides the gang's.
	annotations map[string]string
}

// writes lists every claim write of a plan: the domain claim first, with
// the placement's nodes and their addresses (for the nodes' IMEX daemons),
// then each member's claims with its node.
func writes(g *gangv1.Gang, v *view, p *plan, nodes map[string]*v1.Node) []claimWrite {
	var out []claimWrite
	if p.domainAlloc != nil {
		var pods []*v1.Pod
		for _, m := range p.members {
			pods = append(pods, m.pod)
		}
		out = append(out, claimWrite{claim: v.domainClaim, alloc: *p.domainAlloc, allocate: true, pods: pods,
			annotations: map[string]string{gangv1.AnnotationNodes: gangv1.FormatNodes(placementNodes(p.nodes, nodes))}})
	}
	for i, m := range p.members {
		for j, c := range m.claims {
			a := m.annotations()
			a[gangv1.AnnotationNode] = p.nodes[i]
			out = append(out, claimWrite{claim: c, alloc: p.allocs[i][j], pods: []*v1.Pod{m.pod}, annotations: a})
		}
	}
	return out
}

// placementNodes are the distinct nodes of a placement, sorted, each with
// its first InternalIP ("" when it has none).
func placementNodes(names []string, nodes map[string]*v1.Node) []gangv1.Node {
	set := map[string]bool{}
	var out []gangv1.Node
	for _, name := range names {
		if set[name] {
			continue
		}
		set[name] = true
		n := gangv1.Node{Name: name}
		if node := nodes[name]; node != nil {
			n.Address = internalIP(node)
		}
		out = append(out, n)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// planned is each claim of the writes as it would be once written.
func planned(ws []claimWrite) []*resourceapi.ResourceClaim {
	out := make([]*resourceapi.ResourceClaim, len(ws))
	for i, w := range ws {
		c := w.claim.DeepCopy()
		c.Status.Allocation = w.alloc.DeepCopy()
		out[i] = c
	}
	return out
}

// parallel runs f for 0..n-1 with bounded concurrency and joins the errors.
func parallel(n int, f func(i int) error) error {
	errs := make([]error, n)
	sem := make(chan struct{}, writeParallelism)
	var wg sync.WaitGroup
	for i := range n {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			errs[i] = f(i)
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// writeClaim annotates the claim (gang, size, placement, rank; a member's
// node). For the domain claim (w.allocate) it then adds the delete-protection
// finalizer and writes the channel's allocation, with the gang's binding
// conditions, and its reservation for every member, as the scheduler would.
// It returns the claim as written.
func writeClaim(ctx context.Context, client kubernetes.Interface, g *gangv1.Gang, id string, w claimWrite) (*resourceapi.ResourceClaim, error) {
	claims := client.ResourceV1().ResourceClaims(w.claim.Namespace)
	c := w.claim.DeepCopy()
	var updated *resourceapi.ResourceClaim
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		if c.Status.Allocation != nil && w.allocate {
			return fmt.Errorf("claim %s/%s was allocated by someone else meanwhile", c.Namespace, c.Name)
		}
		if c.Annotations == nil {
			c.Annotations = map[string]string{}
		}
		c.Annotations[gangv1.AnnotationGang] = g.Namespace + "/" + g.Name
		_, most := gangv1.Bounds(&g.Spec)
		c.Annotations[gangv1.AnnotationSize] = strconv.Itoa(int(most))
		c.Annotations[gangv1.AnnotationPlacement] = id
		for k, val := range w.annotations {
			c.Annotations[k] = val
		}
		if w.allocate && !slices.Contains(c.Finalizers, deleteProtection) {
			c.Finalizers = append(c.Finalizers, deleteProtection)
		}
		var err error
		updated, err = claims.Update(ctx, c, metav1.UpdateOptions{})
		if apierrors.IsConflict(err) {
			if fresh, gerr := claims.Get(ctx, c.Name, metav1.GetOptions{}); gerr == nil {
				c = fresh
			}
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("annotate claim %s/%s: %w", w.claim.Namespace, w.claim.Name, err)
	}
	if !w.allocate {
		return updated, nil
	}
	alloc := w.alloc.DeepCopy()
	alloc.AllocationTimestamp = &metav1.Time{Time: time.Now()}
	for i := range alloc.Devices.Results {
		alloc.Devices.Results[i].BindingConditions = []string{domain.ConditionMembersAllocated}
		alloc.Devices.Results[i].BindingFailureConditions = []string{domain.ConditionPlacementFailed}
	}
	updated.Status.Allocation = alloc
	updated.Status.ReservedFor = nil
	for _, p := range w.pods {
		updated.Status.ReservedFor = append(updated.Status.ReservedFor, resourceapi.ResourceClaimConsumerReference{Resource: "pods", Name: p.Name, UID: p.UID})
	}
	out, err := claims.UpdateStatus(ctx, updated, metav1.UpdateOptions{})
	if err != nil {
		return nil, fmt.Errorf("write allocation of claim %s/%s: %w", w.claim.Namespace, w.claim.Name, err)
	}
	return out, nil
}

// clearClaim removes a claim's allocation and reservation, if it is still
// the one of placement id (any placement when id is empty), the
// controller's own (an allocation of domain channels only) and in no
// released member's use. An allocation the scheduler made (any other
// device) is never touched: clearing one is for its pod's end and the
// resourceclaim controller. Nor is one reserved for a pod that exists and
// is released (inUseBy), whatever asks: its members run on the channel, and
// a cleared claim's devices are handed out again. Both refusals leave the
// claim as it is and are not errors (cleared is false).
func clearClaim(ctx context.Context, client kubernetes.Interface, ns, name, id string) (cleared bool, _ error) {
	claims := client.ResourceV1().ResourceClaims(ns)
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		cleared = false
		c, err := claims.Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return nil
		}
		if err != nil {
			return err
		}
		if c.Status.Allocation == nil || (id != "" && c.Annotations[gangv1.AnnotationPlacement] != id) || !channelsOnly(c.Status.Allocation) {
			return nil
		}
		if pod, err := inUseBy(ctx, client, c); err != nil {
			return err
		} else if pod != "" {
			klog.FromContext(ctx).V(2).Info("Not clearing a domain claim a released member uses", "claim", klog.KObj(c), "pod", pod)
			return nil
		}
		c.Status.Allocation = nil
		c.Status.ReservedFor = nil
		c.Status.Devices = nil
		_, err = claims.UpdateStatus(ctx, c, metav1.UpdateOptions{})
		cleared = err == nil
		return err
	})
	return cleared, err
}

// channelsOnly says whether every device of an allocation is a domain
// channel: what only the controller allocates.
func channelsOnly(a *resourceapi.AllocationResult) bool {
	for _, r := range a.Devices.Results {
		if !strings.HasPrefix(r.Pool, domain.PoolPrefix) {
			return false
		}
	}
	return len(a.Devices.Results) > 0
}

// conflicts re-reads every claim from the API server and checks that the
// placement's claims (as planned, or as written) still fit beside every
// other allocated claim (misfit): the scheduler (or a second allocator) may
// have taken, since the snapshot, one of the devices, a partition of a whole
// GPU the gang got (shared counters), or more of a shared GPU's time slices
// or memory than is left (consumable capacity). It says which claim no
// longer fits and beside which; "" when all do.
func conflicts(ctx context.Context, client kubernetes.Interface, snap *simulate.Snapshot, nodes map[string]*v1.Node, written []*resourceapi.ResourceClaim) (string, error) {
	all, err := simulate.ListClaims(ctx, client)
	if err != nil {
		return "", err
	}
	return misfit(ctx, &simulate.Snapshot{Classes: snap.Classes, Slices: snap.Slices, Claims: all}, nodes, written)
}

// misfit judges allocated claims with the scheduler's allocator over the
// snapshot's slices, beside every other allocated claim of the snapshot in
// the pools they use, each confined to the devices it was allocated
// (simulate.Cluster.Refit), and each beside the ones before it. It says
// which claim does not fit and beside which others; "" when all fit.
func misfit(ctx context.Context, snap *simulate.Snapshot, nodes map[string]*v1.Node, claims []*resourceapi.ResourceClaim) (string, error) {
	return judge(ctx, snap, nodes, claims, false)
}

// heldMisfit is misfit for claims the scheduler allocated already, judged
// as their holders (simulate.Cluster.RefitHeld): a taint on one of their
// devices, or a lazily published partition being withdrawn, takes nothing
// from them; only another claim holding what they hold does.
func heldMisfit(ctx context.Context, snap *simulate.Snapshot, nodes map[string]*v1.Node, claims []*resourceapi.ResourceClaim) (string, error) {
	return judge(ctx, snap, nodes, claims, true)
}

// judge is misfit, or heldMisfit if held.
func judge(ctx context.Context, snap *simulate.Snapshot, nodes map[string]*v1.Node, claims []*resourceapi.ResourceClaim, held bool) (string, error) {
	judged := map[types.UID]bool{}
	pools := map[string]bool{} // driver/pool
	for _, c := range claims {
		judged[c.UID] = true
		if c.Status.Allocation == nil {
			continue
		}
		for _, r := range c.Status.Allocation.Devices.Results {
			pools[r.Driver+"/"+r.Pool] = true
		}
	}
	cluster := snap.Cluster(
		func(s *resourceapi.ResourceSlice) bool { return pools[s.Spec.Driver+"/"+s.Spec.Pool.Name] },
		func(c *resourceapi.ResourceClaim) bool { return judged[c.UID] })
	for _, c := range claims {
		if c.Status.Allocation == nil {
			continue
		}
		if channelsOnly(c.Status.Allocation) {
			c = domain.Tolerating(c) // as the controller allocated it
		}
		refit := cluster.Refit
		if held {
			refit = cluster.RefitHeld
		}
		fits, err := refit(ctx, allocationNode(c.Status.Allocation, nodes), c)
		if err != nil {
			return "", err
		}
		if !fits {
			return notFitting(c, snap.Claims, snap.Slices), nil
		}
	}
	return "", nil
}

// notFitting says which claims a claim of the placement no longer fits
// beside: those holding one of its devices, or a device drawing on the same
// counters (another partition of the same GPU).
func notFitting(c *resourceapi.ResourceClaim, all []*resourceapi.ResourceClaim, slices []*resourceapi.ResourceSlice) string {
	counters := map[string][]string{} // driver/pool/device -> driver/pool/counter set
	for _, s := range slices {
		for _, d := range s.Spec.Devices {
			for _, cc := range d.ConsumesCounters {
				key := s.Spec.Driver + "/" + s.Spec.Pool.Name + "/"
				counters[key+d.Name] = append(counters[key+d.Name], key+cc.CounterSet)
			}
		}
	}
	mine := map[string]bool{} // devices and counter sets of c
	var devices []string
	for _, r := range c.Status.Allocation.Devices.Results {
		key := r.Driver + "/" + r.Pool + "/" + r.Device
		mine[key] = true
		for _, set := range counters[key] {
			mine[set] = true
		}
		devices = append(devices, r.Pool+"/"+r.Device)
	}
	var rivals []string
	for _, o := range all {
		if o.Status.Allocation == nil || o.UID == c.UID {
			continue
		}
		for _, r := range o.Status.Allocation.Devices.Results {
			key := r.Driver + "/" + r.Pool + "/" + r.Device
			touches := mine[key]
			for _, set := range counters[key] {
				touches = touches || mine[set]
			}
			if touches && (r.AdminAccess == nil || !*r.AdminAccess) {
				rivals = append(rivals, fmt.Sprintf("claim %s/%s (%s/%s)", o.Namespace, o.Name, r.Pool, r.Device))
				break
			}
		}
	}
	what := fmt.Sprintf("claim %s/%s (%s) no longer fits", c.Namespace, c.Name, strings.Join(devices, ", "))
	if len(rivals) == 0 {
		return what + " beside the other allocations of its pools"
	}
	if len(rivals) > 3 {
		rivals = append(rivals[:3], fmt.Sprintf("%d more", len(rivals)-3))
	}
	return what + " beside " + strings.Join(rivals, ", ") + " (the same device, another partition of its GPU, or more of a shared GPU than is left)"
}

// allocationNode is a node an allocation's selector points to, as the
// allocator needs one to pick the pools' slices: the node of a node-local
// allocation, else the first known node its selector matches.
func allocationNode(a *resourceapi.AllocationResult, nodes map[string]*v1.Node) *v1.Node {
	if name := nodeNameOf(a.NodeSelector); name != "" {
		if n, ok := nodes[name]; ok {
			return n
		}
		return &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{v1.LabelHostname: name}}}
	}
	names := make([]string, 0, len(nodes))
	for name := range nodes {
		names = append(names, name)
	}
	sort.Strings(names)
	var sel *nodeaffinity.NodeSelector
	if a.NodeSelector != nil {
		sel, _ = nodeaffinity.NewNodeSelector(a.NodeSelector)
	}
	for _, name := range names {
		if sel == nil || sel.Match(nodes[name]) {
			return nodes[name]
		}
	}
	return &v1.Node{}
}

// release narrows a gated member to its node (if it has one: a member
// without claims of its own is confined by the domain claim alone), records
// its placement, rank and role, and removes the gate, in one update (a gated
// pod accepts added node affinity). A member already released is left alone.
func release(ctx context.Context, client kubernetes.Interface, m *member, node, id string) error {
	pod := m.pod
	pods := client.CoreV1().Pods(pod.Namespace)
	p := pod.DeepCopy()
	return retry.RetryOnConflict(retry.DefaultRetry, func() error {
		if !hasGate(p) {
			return nil
		}
		if p.Annotations == nil {
			p.Annotations = map[string]string{}
		}
		p.Annotations[gangv1.AnnotationPlacement] = id
		for k, val := range m.annotations() {
			p.Annotations[k] = val
		}
		if node != "" {
			pinTo(p, node)
		}
		p.Spec.SchedulingGates = slices.DeleteFunc(p.Spec.SchedulingGates, func(g v1.PodSchedulingGate) bool { return g.Name == gangv1.SchedulingGate })
		_, err := pods.Update(ctx, p, metav1.UpdateOptions{})
		if apierrors.IsConflict(err) {
			if fresh, gerr := pods.Get(ctx, p.Name, metav1.GetOptions{}); gerr == nil {
				p = fresh
			}
		}
		if err != nil && !apierrors.IsConflict(err) {
			return fmt.Errorf("release member %s/%s to node %s: %w", pod.Namespace, pod.Name, node, err)
		}
		return err
	})
}

// pinTo adds a required node affinity for node: a new term when the pod has
// none, else the requirement added to each of its terms (only additions are
// allowed on a gated pod).
func pinTo(p *v1.Pod, node string) {
	req := v1.NodeSelectorRequirement{Key: "metadata.name", Operator: v1.NodeSelectorOpIn, Values: []string{node}}
	if p.Spec.Affinity == nil {
		p.Spec.Affinity = &v1.Affinity{}
	}
	if p.Spec.Affinity.NodeAffinity == nil {
		p.Spec.Affinity.NodeAffinity = &v1.NodeAffinity{}
	}
	na := p.Spec.Affinity.NodeAffinity
	if na.RequiredDuringSchedulingIgnoredDuringExecution == nil || len(na.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms) == 0 {
		na.RequiredDuringSchedulingIgnoredDuringExecution = &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{{MatchFields: []v1.NodeSelectorRequirement{req}}}}
		return
	}
	terms := na.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms
	for i := range terms {
		terms[i].MatchFields = append(terms[i].MatchFields, req)
	}
}

// evict evicts a pod (a member of a gang that lost one, a victim of a
// preemption, a backfill pod) through the Eviction API, which marks it with
// the DisruptionTarget condition (a Job's podFailurePolicy can ignore that).
func evict(ctx context.Context, client kubernetes.Interface, p *v1.Pod) error {
	err := client.CoreV1().Pods(p.Namespace).EvictV1(ctx, &policyv1.Eviction{ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: p.Namespace}})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("evict pod %s/%s: %w", p.Namespace, p.Name, err)
	}
	klog.FromContext(ctx).V(2).Info("Evicted pod", "pod", klog.KObj(p))
	return nil
}
