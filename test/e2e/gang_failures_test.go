package e2e

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/utils/ptr"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/controller/gang"
)

// This file holds TestGangPlacement's failure subtests: the outcomes
// docs/gang.md promises for a device taken between the fit check and the
// commit, a member failing, a gang deleted, and a node leaving.

// gangEnv is what the failure subtests share with TestGangPlacement.
type gangEnv struct {
	// parent is TestGangPlacement's t: controllers meant to outlive a
	// subtest are tied to it (a subtest's cleanups would stop them).
	parent     *testing.T
	c          *tesseraCluster
	gs         gangs
	kubeconfig string
	// ctl is the running controller; subtests that need another stop it
	// and leave a plain one running.
	ctl **runningController
}

// setUp makes a namespace with a one-GPU template and a domain claim.
func (e gangEnv) setUp(ctx context.Context, t *testing.T, ns string) {
	t.Helper()
	e.c.newNamespace(ctx, t, ns)
	client := e.c.Client()
	e.c.createTemplates(ctx, t, gpuTemplate(ns, "one-gpu", 1))
	noErr(t, ok(client.ResourceV1().ResourceClaims(ns).Create(ctx, domainClaim(ns, "g-domain"), metav1.CreateOptions{})))
}

// restartController replaces the running controller with one that has
// the interrupt hook (nil: a plain one).
func (e gangEnv) restartController(t *testing.T, interrupt func(string) bool) *runningController {
	t.Helper()
	if err := (*e.ctl).stop(); err != nil {
		t.Fatalf("stop the controller: %v", err)
	}
	*e.ctl = startController(e.parent, e.kubeconfig, "", interrupt)
	return *e.ctl
}

// deviceTakenBeforeTheRelease: between the placement and the release of
// the gates, the scheduler gives another pod a GPU of the tray the members
// were placed on, which they filled. The scheduler allocates three members
// there and cannot allocate the fourth; the three wait to bind (the domain
// claim's binding conditions), so no member of that placement ever binds or
// starts. After the grace the controller fails their binding and evicts
// them, the Job recreates them, and the gang runs as a new placement without
// the rival's GPU. No device is allocated to two claims at any instant: the
// scheduler made every GPU allocation, the controller only the channel.
func (e gangEnv) deviceTakenBeforeTheRelease(ctx context.Context, t *testing.T) {
	const ns = "race"
	e.setUp(ctx, t, ns)
	client := e.c.Client()
	// The rival: a one-GPU pod held back by a gate of its own, pinned to the
	// members' tray and released at the release step.
	rival := newGPUPod(ns, "rival", gpuFrom("one-gpu"))
	rival.Spec.SchedulingGates = []corev1.PodSchedulingGate{{Name: "example.com/hold"}}
	noErr(t, ok(client.CoreV1().Pods(ns).Create(ctx, rival, metav1.CreateOptions{})))
	t.Cleanup(func() { e.c.deletePodsAndWait(context.WithoutCancel(ctx), t, rival) })

	var firstPlacement, takenOn atomic.Pointer[string]
	take := func() error {
		list, err := client.ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		for _, mc := range list.Items {
			node := mc.Annotations[gangv1.AnnotationNode]
			if mc.Annotations[gangv1.AnnotationRank] != "0" || node == "" {
				continue
			}
			p, err := client.CoreV1().Pods(ns).Get(ctx, rival.Name, metav1.GetOptions{})
			if err != nil {
				return err
			}
			p.Spec.SchedulingGates = nil
			p.Spec.Affinity = &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{
				NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchFields: []corev1.NodeSelectorRequirement{{Key: "metadata.name", Operator: corev1.NodeSelectorOpIn, Values: []string{node}}}}},
			}}}
			if _, err := client.CoreV1().Pods(ns).Update(ctx, p, metav1.UpdateOptions{}); err != nil {
				return err
			}
			err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
				p, err := client.CoreV1().Pods(ns).Get(ctx, rival.Name, metav1.GetOptions{})
				return err == nil && p.Spec.NodeName == node, nil
			})
			if err != nil {
				return fmt.Errorf("the scheduler did not bind the rival to %s: %w", node, err)
			}
			firstPlacement.Store(ptr.To(mc.Annotations[gangv1.AnnotationPlacement]))
			takenOn.Store(ptr.To(node))
			return nil
		}
		return fmt.Errorf("no claim of rank 0 written with its node")
	}
	// Every member pod that was ever bound, and its placement.
	var mu sync.Mutex
	bound := map[string]string{}
	w, err := client.CoreV1().Pods(ns).Watch(ctx, metav1.ListOptions{LabelSelector: jobName + "=train"})
	noErr(t, err)
	defer w.Stop()
	go func() {
		for ev := range w.ResultChan() {
			if p, ok := ev.Object.(*corev1.Pod); ok && p.Spec.NodeName != "" {
				mu.Lock()
				bound[p.Name] = p.Annotations[gangv1.AnnotationPlacement]
				mu.Unlock()
			}
		}
	}()
	var done atomic.Bool
	var takeErr atomic.Value
	e.restartController(t, func(step string) bool {
		if step == gang.StepRelease && !done.Swap(true) {
			if err := take(); err != nil {
				takeErr.Store(err)
			}
		}
		return false
	})
	e.trainJobGang(ctx, t, ns)

	var pods []corev1.Pod
	eventually(ctx, t, 3*time.Minute, "the gang running whole as a second placement", func() bool {
		if takeErr.Load() != nil || firstPlacement.Load() == nil {
			return takeErr.Load() != nil
		}
		list, err := client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: jobName + "=train"})
		if err != nil {
			return false
		}
		pods = pods[:0]
		for _, p := range list.Items {
			if p.Status.Phase == corev1.PodRunning && p.DeletionTimestamp == nil && p.Annotations[gangv1.AnnotationPlacement] != *firstPlacement.Load() {
				pods = append(pods, p)
			}
		}
		return len(pods) == 4
	})
	if err, _ := takeErr.Load().(error); err != nil {
		t.Fatalf("releasing the rival onto the members' tray: %v", err)
	}
	first, node := *firstPlacement.Load(), *takenOn.Load()
	mu.Lock()
	for pod, placement := range bound {
		if placement == first {
			t.Errorf("member %s of the placement that could not be completed was bound: the members must bind together or not at all", pod)
		}
	}
	mu.Unlock()
	if !e.c.hasEvent(ctx, ns, "train", gangv1.ReasonMemberLost) || !strings.Contains(e.c.events(ctx, ns), "cannot be scheduled on the node it was placed on") {
		t.Errorf("no %s event naming the unschedulable member; events:\n%s", gangv1.ReasonMemberLost, e.c.events(ctx, ns))
	}
	rp, err := client.CoreV1().Pods(ns).Get(ctx, rival.Name, metav1.GetOptions{})
	noErr(t, err)
	rc := e.c.claimOf(ctx, t, rp, "gpu")
	if rc.Status.Allocation == nil {
		t.Fatal("the rival lost its GPU")
	}
	r := rc.Status.Allocation.Devices.Results[0]
	held := map[string]string{rc.Name: r.Pool + "/" + r.Device}
	seen := map[string]string{r.Pool + "/" + r.Device: rc.Name}
	for i := range pods {
		for _, res := range e.c.claimOf(ctx, t, &pods[i], "gpu").Status.Allocation.Devices.Results {
			key := res.Pool + "/" + res.Device
			if other, dup := seen[key]; dup {
				t.Errorf("device %s held by %s and member %s", key, other, pods[i].Name)
			}
			seen[key] = pods[i].Name
			held[pods[i].Name] = key
		}
	}
	t.Logf("the rival took %s/%s on %s after placement %s; no member of it bound; the gang runs again on %v", r.Pool, r.Device, node, first, held)
	e.c.deleteGangAndMembers(ctx, t, e.gs, ns, "train")
	e.restartController(t, nil)
}

// trainJobGang creates in ns the gang "train" of the 4 one-GPU pods of the
// indexed Job "train", sharing domain claim g-domain (setUp), and deletes
// both at the test's end.
func (e gangEnv) trainJobGang(ctx context.Context, t *testing.T, ns string) {
	t.Helper()
	e.gs.create(ctx, t, &gangv1.Gang{
		ObjectMeta: metav1.ObjectMeta{Name: "train", Namespace: ns},
		Spec:       gangv1.GangSpec{Size: 4, DomainClaimName: "g-domain", Selector: metav1.LabelSelector{MatchLabels: map[string]string{jobName: "train"}}},
	})
	noErr(t, ok(e.c.Client().BatchV1().Jobs(ns).Create(ctx, indexedJob(ns, "train", 4, "one-gpu", "g-domain"), metav1.CreateOptions{})))
	t.Cleanup(func() { e.c.deleteJob(context.WithoutCancel(ctx), t, ns, "train") })
	t.Cleanup(func() { e.gs.delete(context.WithoutCancel(ctx), t, ns, "train") })
}

// memberFails: one member of a running Job gang exits with an error. The
// controller evicts the others (the Job's podFailurePolicy ignores
// evictions), the Job recreates its members, and the gang is placed again
// as a new placement; nothing of the old one stays allocated.
func (e gangEnv) memberFails(ctx context.Context, t *testing.T) {
	const ns = "fail"
	e.setUp(ctx, t, ns)
	client := e.c.Client()
	old, g := e.c.runJobGang(ctx, t, e.gs, ns, "train", "one-gpu", "g-domain", 4)
	first := g.Annotations[gangv1.AnnotationCommitted]
	victim := old[0]
	if err := e.c.Node(victim.Spec.NodeName).ExitContainer(string(victim.UID), "main", 1); err != nil {
		t.Fatal(err)
	}
	oldUIDs := map[string]bool{}
	for _, p := range old {
		oldUIDs[string(p.UID)] = true
	}
	var second string
	var pods []corev1.Pod
	err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 3*time.Minute, true, func(context.Context) (bool, error) {
		second = e.gs.get(ctx, t, ns, "train").Annotations[gangv1.AnnotationCommitted]
		list, err := client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: jobName + "=train"})
		if err != nil || second == "" || second == first {
			return false, nil
		}
		pods = pods[:0]
		for _, p := range list.Items {
			if p.Status.Phase == corev1.PodRunning && p.DeletionTimestamp == nil && !oldUIDs[string(p.UID)] && p.Annotations[gangv1.AnnotationPlacement] == second {
				pods = append(pods, p)
			}
		}
		return len(pods) == 4, nil
	})
	if err != nil {
		var b strings.Builder
		list, _ := client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		for _, p := range list.Items {
			fmt.Fprintf(&b, "  pod %s: %s node=%q gates=%v placement=%q deleting=%v\n", p.Name, p.Status.Phase, p.Spec.NodeName, p.Spec.SchedulingGates, p.Annotations[gangv1.AnnotationPlacement], p.DeletionTimestamp != nil)
		}
		if job, err := client.BatchV1().Jobs(ns).Get(ctx, "train", metav1.GetOptions{}); err == nil {
			fmt.Fprintf(&b, "  job: active=%d failed=%d terminating=%v ready=%v failedIndexes=%v conditions=%+v\n", job.Status.Active, job.Status.Failed, ptr.Deref(job.Status.Terminating, -1), ptr.Deref(job.Status.Ready, -1), ptr.Deref(job.Status.FailedIndexes, ""), job.Status.Conditions)
		}
		for _, p := range list.Items {
			fmt.Fprintf(&b, "  pod %s: finalizers=%v conditions=%v\n", p.Name, p.Finalizers, p.Status.Conditions)
		}
		claims, _ := client.ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
		for _, c := range claims.Items {
			fmt.Fprintf(&b, "  claim %s: allocated=%v placement=%q reservedFor=%v\n", c.Name, c.Status.Allocation != nil, c.Annotations[gangv1.AnnotationPlacement], c.Status.ReservedFor)
		}
		t.Fatalf("the gang was not placed again after member %s failed (placement %q, was %q):\n%s%s\nevents:\n%s", victim.Name, second, first, describeConditions(e.gs.get(ctx, t, ns, "train")), b.String(), e.c.events(ctx, ns))
	}
	if !e.c.hasEvent(ctx, ns, "train", gangv1.ReasonMemberLost) {
		t.Errorf("no %s event on the gang; events:\n%s", gangv1.ReasonMemberLost, e.c.events(ctx, ns))
	}
	// The other old members were evicted, not left running beside the new
	// placement.
	for _, p := range old {
		cur, err := client.CoreV1().Pods(ns).Get(ctx, p.Name, metav1.GetOptions{})
		if err == nil && cur.Status.Phase == corev1.PodRunning && cur.DeletionTimestamp == nil {
			t.Errorf("old member %s still runs beside the new placement", p.Name)
		}
	}
	// Only the new placement holds devices once the old members are gone.
	waitFor(ctx, t, "only claims of placement "+second+" allocated", func() bool {
		list, err := client.ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false
		}
		for _, c := range list.Items {
			if c.Status.Allocation != nil && c.Annotations[gangv1.AnnotationPlacement] != second {
				return false
			}
		}
		return true
	})
	e.gs.waitCondition(ctx, t, ns, "train", gangv1.ConditionRunning, metav1.ConditionTrue, time.Minute)
	t.Logf("member %s failed: placement %s replaced by %s", victim.Name, first, second)
}

// memberUnschedulable: between the placement and the release of the gates,
// another pod takes the CPU of the node the members were placed on, so the
// scheduler cannot bind them there. After the grace period the controller
// evicts them (they hold devices without running), the Job recreates them,
// and the gang is placed again on a node with room.
func (e gangEnv) memberUnschedulable(ctx context.Context, t *testing.T) {
	const ns = "stuck"
	e.setUp(ctx, t, ns)
	client := e.c.Client()
	var hogged atomic.Value
	hog := func() error {
		list, err := client.ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		for _, mc := range list.Items {
			if mc.Annotations[gangv1.AnnotationRank] != "0" || mc.Annotations[gangv1.AnnotationNode] == "" {
				continue
			}
			node := mc.Annotations[gangv1.AnnotationNode]
			n, err := client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
			if err != nil {
				return err
			}
			cpu := n.Status.Allocatable[corev1.ResourceCPU]
			cpu.Sub(resource.MustParse("100m"))
			p := &corev1.Pod{
				ObjectMeta: metav1.ObjectMeta{Name: "hog", Namespace: ns},
				Spec: corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{
					Name: "hog", Image: "registry.k8s.io/pause:3.10",
					Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceCPU: cpu}},
				}}},
			}
			if _, err := client.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{}); err != nil {
				return err
			}
			hogged.Store(node)
			return nil
		}
		return fmt.Errorf("no claim of rank 0 written")
	}
	var done atomic.Bool
	var hogErr atomic.Value
	e.restartController(t, func(step string) bool {
		if step == gang.StepRelease && !done.Swap(true) {
			if err := hog(); err != nil {
				hogErr.Store(err)
			}
		}
		return false
	})
	job := indexedJob(ns, "train", 4, "one-gpu", "g-domain")
	for i := range job.Spec.Template.Spec.Containers {
		job.Spec.Template.Spec.Containers[i].Resources.Requests = corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("200m")}
	}
	e.gs.create(ctx, t, &gangv1.Gang{
		ObjectMeta: metav1.ObjectMeta{Name: "train", Namespace: ns},
		Spec:       gangv1.GangSpec{Size: 4, DomainClaimName: "g-domain", Selector: metav1.LabelSelector{MatchLabels: map[string]string{jobName: "train"}}},
	})
	noErr(t, ok(client.BatchV1().Jobs(ns).Create(ctx, job, metav1.CreateOptions{})))
	t.Cleanup(func() { e.c.deleteJob(context.WithoutCancel(ctx), t, ns, "train") })
	t.Cleanup(func() { e.gs.delete(context.WithoutCancel(ctx), t, ns, "train") })

	pods := e.c.waitAllRunning(ctx, t, ns, jobName+"=train", 4, 3*time.Minute)
	if err, _ := hogErr.Load().(error); err != nil {
		t.Fatalf("filling the node: %v", err)
	}
	node, _ := hogged.Load().(string)
	if node == "" {
		t.Fatal("the hook never ran at the release step")
	}
	for _, p := range pods {
		if p.Spec.NodeName == node {
			t.Errorf("member %s runs on %s, whose CPU the hog holds", p.Name, node)
		}
	}
	if !e.c.hasEvent(ctx, ns, "train", gangv1.ReasonMemberLost) || !strings.Contains(e.c.events(ctx, ns), "cannot be scheduled on the node it was placed on") {
		t.Errorf("no %s event naming the unschedulable member; events:\n%s", gangv1.ReasonMemberLost, e.c.events(ctx, ns))
	}
	e.gs.waitCondition(ctx, t, ns, "train", gangv1.ConditionRunning, metav1.ConditionTrue, time.Minute)
	t.Logf("%s filled up after the placement; the gang now runs on %v", node, nodesOf(pods))
	e.c.deletePodsAndWait(ctx, t, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "hog", Namespace: ns}})
	e.restartController(t, nil)
}

func nodesOf(pods []corev1.Pod) []string {
	var out []string
	for _, p := range pods {
		out = append(out, p.Spec.NodeName)
	}
	return out
}

// gangDeleted: deleting a running gang leaves its members running; deleting
// a gang whose placement a crash cut short frees the claims it had written
// and leaves its members gated.
func (e gangEnv) gangDeleted(ctx context.Context, t *testing.T) {
	const ns = "delete"
	e.setUp(ctx, t, ns)
	client := e.c.Client()
	noErr(t, ok(client.ResourceV1().ResourceClaims(ns).Create(ctx, domainClaim(ns, "cut-domain"), metav1.CreateOptions{})))

	e.gs.create(ctx, t, labelGang(ns, "keep", 2, "g-domain"))
	e.c.createMembers(ctx, t, ns, "keep", "one-gpu", "g-domain", 2)
	running := e.c.waitAllRunning(ctx, t, ns, "gang=keep", 2, 3*time.Minute)
	e.gs.delete(ctx, t, ns, "keep") // waits until the finalizer is gone
	for _, p := range running {
		cur, err := client.CoreV1().Pods(ns).Get(ctx, p.Name, metav1.GetOptions{})
		if err != nil || cur.UID != p.UID || cur.Status.Phase != corev1.PodRunning || cur.DeletionTimestamp != nil {
			t.Errorf("member %s of a deleted gang no longer runs: %v", p.Name, err)
			continue
		}
		if c := e.c.claimOf(ctx, t, cur, "gpu"); c.Status.Allocation == nil {
			t.Errorf("member %s lost its GPU with its gang", p.Name)
		}
	}
	if dc := getClaim(ctx, t, e.c, ns, "g-domain"); dc.Status.Allocation == nil {
		t.Error("the domain claim of running members was freed with their gang")
	}

	var reached atomic.Int32
	dying := e.restartController(t, func(step string) bool {
		return step == gang.StepClaimWritten && reached.Add(1) == 2
	})
	e.gs.create(ctx, t, labelGang(ns, "cut", 4, "cut-domain"))
	e.c.createMembers(ctx, t, ns, "cut", "one-gpu", "cut-domain", 4)
	select {
	case <-dying.done:
	case <-time.After(2 * time.Minute):
		t.Fatal("the controller was not interrupted")
	}
	allocated := e.c.cutPlacementWrote(ctx, t, ns, "cut", "cut-domain")
	err := e.gs.dyn.Resource(gangv1.GroupVersionResource).Namespace(ns).Delete(ctx, "cut", metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		t.Fatal(err)
	}
	*e.ctl = startController(e.parent, e.kubeconfig, "", nil)
	e.gs.delete(ctx, t, ns, "cut") // gone once the new leader finalized it
	e.c.checkHeldNothing(ctx, t, ns, e.c.gangPods(ctx, t, ns, "cut"), "cut-domain")
	t.Logf("deleted gang keep: 2 members run on; deleted gang cut: %d claims written before the crash freed", allocated)

	e.c.deleteGangPods(ctx, t, ns, "keep", "cut")
}

// nodeLeaves: the node of a running gang leaves the cluster (its kubelet
// stops and the Node is deleted, as a cloud provider does). The pod GC
// deletes its pods, the controller reports the loss, the Job recreates the
// members, and the gang is placed again in a domain that still fits.
func (e gangEnv) nodeLeaves(ctx context.Context, t *testing.T) {
	const ns = "leave"
	e.setUp(ctx, t, ns)
	client := e.c.Client()
	_, g := e.c.runJobGang(ctx, t, e.gs, ns, "edge", "one-gpu", "g-domain", 4)
	if !slices.Equal(g.Status.Nodes, []string{"tray-b1"}) {
		t.Fatalf("gang placed on %v, want the smallest domain, clique B's tray-b1", g.Status.Nodes)
	}
	e.c.nodes["tray-b1"].StopPlugin()
	e.c.Node("tray-b1").StopKubelet()
	noErr(t, client.CoreV1().Nodes().Delete(ctx, "tray-b1", metav1.DeleteOptions{}))
	began := time.Now()

	var pods []corev1.Pod
	err := wait.PollUntilContextTimeout(ctx, time.Second, 4*time.Minute, true, func(ctx context.Context) (bool, error) {
		list, err := client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: jobName + "=edge"})
		if err != nil {
			return false, nil
		}
		pods = pods[:0]
		for _, p := range list.Items {
			if p.Status.Phase == corev1.PodRunning && p.DeletionTimestamp == nil && p.Spec.NodeName != "tray-b1" {
				pods = append(pods, p)
			}
		}
		return len(pods) == 4, nil
	})
	if err != nil {
		t.Fatalf("the gang was not placed again after its node left:\n%s\nevents:\n%s", describeConditions(e.gs.get(ctx, t, ns, "edge")), e.c.events(ctx, ns))
	}
	g = e.gs.waitCondition(ctx, t, ns, "edge", gangv1.ConditionRunning, metav1.ConditionTrue, time.Minute)
	if len(g.Status.Domain) < len(poolA) || g.Status.Domain[:len(poolA)] != poolA {
		t.Errorf("gang placed again in %s, want clique A (clique B left with its node)", g.Status.Domain)
	}
	if !e.c.hasEvent(ctx, ns, "edge", gangv1.ReasonMemberLost) {
		t.Errorf("no %s event on the gang; events:\n%s", gangv1.ReasonMemberLost, e.c.events(ctx, ns))
	}
	t.Logf("node tray-b1 left: the gang runs again on %v in %s, %v after the Node was deleted", g.Status.Nodes, g.Status.Domain, time.Since(began).Round(time.Second))
}

// podFailurePolicy ignores evictions: the controller evicts the members of a
// lost placement, which must not count against the Job's backoff.
var podFailurePolicy = &batchv1.PodFailurePolicy{Rules: []batchv1.PodFailurePolicyRule{{
	Action:          batchv1.PodFailurePolicyActionIgnore,
	OnPodConditions: []batchv1.PodFailurePolicyOnPodConditionsPattern{{Type: corev1.DisruptionTarget, Status: corev1.ConditionTrue}},
}}}
