package e2e

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	schedulingv1beta1 "k8s.io/api/scheduling/v1beta1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/utils/ptr"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
)

// waitNamedRunning waits until each named pod runs, and returns them by name.
func (c *tesseraCluster) waitNamedRunning(ctx context.Context, t testing.TB, ns string, timeout time.Duration, names ...string) map[string]corev1.Pod {
	t.Helper()
	out := map[string]corev1.Pod{}
	err := wait.PollUntilContextTimeout(ctx, 300*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		for _, name := range names {
			p, err := c.Client().CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
			if err != nil || p.Status.Phase != corev1.PodRunning || p.DeletionTimestamp != nil {
				return false, nil
			}
			out[name] = *p
		}
		return true, nil
	})
	if err != nil {
		t.Fatalf("pods %v not all running within %v:\n%s\nevents:\n%s", names, timeout, c.describePods(ctx, ns), c.events(ctx, ns))
	}
	return out
}

// describePods is a line per pod of the namespace: phase, node, gates and
// gang annotations.
func (c *tesseraCluster) describePods(ctx context.Context, ns string) string {
	list, err := c.Client().CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return err.Error()
	}
	var b strings.Builder
	for _, p := range list.Items {
		fmt.Fprintf(&b, "  %s: %s node=%q gates=%v placement=%q rank=%q\n", p.Name, p.Status.Phase, p.Spec.NodeName, p.Spec.SchedulingGates,
			p.Annotations[gangv1.AnnotationPlacement], p.Annotations[gangv1.AnnotationRank])
	}
	return b.String()
}

// checkUntouched checks that each pod still exists as the same pod (UID),
// runs, and was never asked to end.
func (c *tesseraCluster) checkUntouched(ctx context.Context, t testing.TB, ns string, pods map[string]types.UID) {
	t.Helper()
	for name, uid := range pods {
		p, err := c.Client().CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil || p.UID != uid || p.DeletionTimestamp != nil || p.Status.Phase != corev1.PodRunning {
			t.Errorf("pod %s was touched: %v", name, err)
			if err == nil {
				t.Errorf("  uid %s (want %s), deleting %v, phase %s", p.UID, uid, p.DeletionTimestamp != nil, p.Status.Phase)
			}
		}
	}
}

// halfOfTrayB1Held makes namespace ns with GPU templates "one-gpu" and
// "two-gpus", and a running pod there holding two of tray-b1's four GPUs,
// which it returns.
func (c *tesseraCluster) halfOfTrayB1Held(ctx context.Context, t *testing.T, ns string) *corev1.Pod {
	t.Helper()
	c.newNamespace(ctx, t, ns)
	c.createTemplates(ctx, t, gpuTemplate(ns, "one-gpu", 1), gpuTemplate(ns, "two-gpus", 2))
	return c.createAndRun(ctx, t, onNode(newGPUPod(ns, "blocker", gpuFrom("two-gpus")), "tray-b1"))
}

// elasticGrowsAndShrinks: a pod holds two of tray-b1's four GPUs (clique B)
// when an elastic gang of minSize 2 and maxSize 4 (one GPU per member) is
// created with four members. It starts with the two that fit, ranks 0 and
// 1; when the pod ends, the other two join the same placement on tray-b1,
// ranks 2 and 3. A member is deleted: the others run on untouched (same
// pods, same placement) and the gang says it shrank. A replacement member,
// whose name sorts last, joins in the same domain with the lost member's
// rank, which its container sees in TESSERA_GANG_RANK.
func (e gangEnv) elasticGrowsAndShrinks(ctx context.Context, t *testing.T) {
	c, gs, client := e.c, e.gs, e.c.Client()
	const ns = "elastic"
	blocker := c.halfOfTrayB1Held(ctx, t, ns)
	noErr(t, ok(client.ResourceV1().ResourceClaims(ns).Create(ctx, domainClaim(ns, "el-domain"), metav1.CreateOptions{})))
	t.Cleanup(func() { c.deleteGangAndMembers(context.WithoutCancel(ctx), t, gs, ns, "el") })
	g := labelGang(ns, "el", 0, "el-domain")
	g.Spec.MinSize, g.Spec.MaxSize = 2, 4
	gs.create(ctx, t, g)
	c.createMembers(ctx, t, ns, "el", "one-gpu", "el-domain", 4)

	// It starts with the two that fit; the other two wait, gated.
	started := c.waitNamedRunning(ctx, t, ns, 3*time.Minute, "el-0", "el-1")
	placed := gs.waitCondition(ctx, t, ns, "el", gangv1.ConditionRunning, metav1.ConditionTrue, time.Minute)
	id := placed.Annotations[gangv1.AnnotationCommitted]
	for _, name := range []string{"el-2", "el-3"} {
		p, err := client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		noErr(t, err)
		if p.Spec.NodeName != "" || len(p.Spec.SchedulingGates) == 0 {
			t.Fatalf("member %s released while there is no room for it:\n%s", name, c.describePods(ctx, ns))
		}
	}
	untouched := map[string]types.UID{}
	for name, p := range started {
		if p.Spec.NodeName != "tray-b1" || p.Annotations[gangv1.AnnotationPlacement] != id || p.Annotations[gangv1.AnnotationRank] != strings.TrimPrefix(name, "el-") {
			t.Errorf("starting member %s: node %q, placement %q (gang's %q), rank %q", name, p.Spec.NodeName, p.Annotations[gangv1.AnnotationPlacement], id, p.Annotations[gangv1.AnnotationRank])
		}
		untouched[name] = p.UID
	}

	// Room appears: the other two join the placement.
	c.deletePodsAndWait(ctx, t, blocker)
	grown := c.waitNamedRunning(ctx, t, ns, 3*time.Minute, "el-2", "el-3")
	for name, p := range grown {
		if p.Spec.NodeName != "tray-b1" || p.Annotations[gangv1.AnnotationPlacement] != id || p.Annotations[gangv1.AnnotationRank] != strings.TrimPrefix(name, "el-") {
			t.Errorf("joining member %s: node %q, placement %q (gang's %q), rank %q", name, p.Spec.NodeName, p.Annotations[gangv1.AnnotationPlacement], id, p.Annotations[gangv1.AnnotationRank])
		}
		untouched[name] = p.UID
	}
	if !c.hasEvent(ctx, ns, "el", gangv1.ReasonGrown) {
		t.Errorf("no %s event; events:\n%s", gangv1.ReasonGrown, c.events(ctx, ns))
	}
	c.checkUntouched(ctx, t, ns, untouched)

	// A member is lost: the gang goes on with the rest.
	lost, err := client.CoreV1().Pods(ns).Get(ctx, "el-1", metav1.GetOptions{})
	noErr(t, err)
	c.deletePodsAndWait(ctx, t, lost)
	delete(untouched, "el-1")
	err = wait.PollUntilContextTimeout(ctx, 300*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		c := meta.FindStatusCondition(gs.get(ctx, t, ns, "el").Status.Conditions, gangv1.ConditionFailed)
		return c != nil && c.Status == metav1.ConditionFalse && c.Reason == gangv1.ReasonShrunk, nil
	})
	if err != nil {
		t.Fatalf("the gang never said it shrank:\n%s", describeConditions(gs.get(ctx, t, ns, "el")))
	}
	if g := gs.get(ctx, t, ns, "el"); g.Annotations[gangv1.AnnotationCommitted] != id || conditionStatus(g, gangv1.ConditionFailed) {
		t.Fatalf("the gang did not go on in its placement:\n%s", describeConditions(g))
	}
	c.checkUntouched(ctx, t, ns, untouched)

	// A replacement takes the lost member's rank, in the same domain.
	noErr(t, ok(client.CoreV1().Pods(ns).Create(ctx, memberPod(ns, "el-9", "el", "one-gpu", "el-domain"), metav1.CreateOptions{})))
	p := c.waitNamedRunning(ctx, t, ns, 3*time.Minute, "el-9")["el-9"]
	if p.Spec.NodeName != "tray-b1" || p.Annotations[gangv1.AnnotationPlacement] != id || p.Annotations[gangv1.AnnotationRank] != "1" {
		t.Errorf("replacement: node %q, placement %q (gang's %q), rank %q; want tray-b1 and rank 1", p.Spec.NodeName, p.Annotations[gangv1.AnnotationPlacement], id, p.Annotations[gangv1.AnnotationRank])
	}
	env := c.containerOf(t, &p).EnvMap()
	if env[gangv1.EnvGangRank] != "1" || env[gangv1.EnvGangSize] != "4" || env[gangv1.EnvDomain] != cliqueB {
		t.Errorf("replacement's env: %s=%q %s=%q %s=%q, want 1, 4 (the gang's most) and %s", gangv1.EnvGangRank, env[gangv1.EnvGangRank], gangv1.EnvGangSize, env[gangv1.EnvGangSize], gangv1.EnvDomain, env[gangv1.EnvDomain], cliqueB)
	}
	c.checkUntouched(ctx, t, ns, untouched)
	t.Logf("elastic gang started with 2, grew to 4, lost el-1 and took el-9 in as rank 1, all in placement %s", id)
}

// leaderKeptWhenWorkersPreempted: clique A's four trays are each full with a
// pod of priority 500; on tray-b1 (clique B) runs a gang of priority 100 of
// a launcher and three workers (one GPU each) whose workers role is elastic
// down to one. A gang of priority 1000 of two one-GPU members fits
// nowhere. It preempts the two workers above the minimum, the highest ranks,
// through the Eviction API, and runs on tray-b1; the launcher and the
// remaining worker run on untouched and their gang stays placed.
func (e gangEnv) leaderKeptWhenWorkersPreempted(ctx context.Context, t *testing.T) {
	c, gs, client := e.c, e.gs, e.c.Client()
	const ns = "leader"
	c.newNamespace(ctx, t, ns)
	c.priorityClasses(ctx, t, 100, 500, 1000)
	c.createTemplates(ctx, t, gpuTemplate(ns, "one-gpu", 1), gpuTemplate(ns, "four-gpus", 4))
	prioritised := func(p *corev1.Pod, value int32) *corev1.Pod {
		p.Spec.PriorityClassName = fmt.Sprintf("tessera-e2e-%d", value)
		return p
	}
	var blockers []*corev1.Pod
	for _, tray := range []string{"tray-a1", "tray-a2", "tray-a3", "tray-a4"} {
		blockers = append(blockers, c.createAndRun(ctx, t, prioritised(onNode(newGPUPod(ns, "mid-"+tray, gpuFrom("four-gpus")), tray), 500)))
	}
	t.Cleanup(func() { c.deletePodsAndWait(context.WithoutCancel(ctx), t, blockers...) })
	for _, name := range []string{"job", "high"} {
		noErr(t, ok(client.ResourceV1().ResourceClaims(ns).Create(ctx, domainClaim(ns, name+"-domain"), metav1.CreateOptions{})))
		t.Cleanup(func() { c.deleteGangAndMembers(context.WithoutCancel(ctx), t, gs, ns, name) })
	}
	job := labelGang(ns, "job", 4, "job-domain")
	job.Spec.Roles = []gangv1.Role{
		{Name: "launcher", Size: 1, Selector: metav1.LabelSelector{MatchLabels: map[string]string{"role": "launcher"}}},
		{Name: "workers", Size: 3, MinSize: 1, Selector: metav1.LabelSelector{MatchLabels: map[string]string{"role": "worker"}}},
	}
	gs.create(ctx, t, job)
	for _, name := range []string{"launcher", "w-0", "w-1", "w-2"} {
		p := prioritised(memberPod(ns, name, "job", "one-gpu", "job-domain"), 100)
		p.Labels["role"] = "worker"
		if name == "launcher" {
			p.Labels["role"] = "launcher"
		}
		noErr(t, ok(client.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{})))
	}
	uids := map[string]types.UID{}
	for _, p := range c.waitAllRunning(ctx, t, ns, "gang=job", 4, 3*time.Minute) {
		if p.Spec.NodeName != "tray-b1" {
			t.Fatalf("member %s runs on %s, want tray-b1", p.Name, p.Spec.NodeName)
		}
		uids[p.Name] = p.UID
	}
	id := gs.get(ctx, t, ns, "job").Annotations[gangv1.AnnotationCommitted]

	gs.create(ctx, t, labelGang(ns, "high", 2, "high-domain"))
	for i := range 2 {
		noErr(t, ok(client.CoreV1().Pods(ns).Create(ctx, prioritised(memberPod(ns, fmt.Sprintf("high-%d", i), "high", "one-gpu", "high-domain"), 1000), metav1.CreateOptions{})))
	}
	for _, p := range c.waitAllRunning(ctx, t, ns, "gang=high", 2, 3*time.Minute) {
		if p.Spec.NodeName != "tray-b1" {
			t.Errorf("high member %s runs on %s, want tray-b1", p.Name, p.Spec.NodeName)
		}
	}
	var preempted []string
	list, err := client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{})
	noErr(t, err)
	for _, ev := range list.Items {
		if ev.Reason == gangv1.ReasonPreempted && ev.InvolvedObject.Kind == "Pod" && !slices.Contains(preempted, ev.InvolvedObject.Name) {
			preempted = append(preempted, ev.InvolvedObject.Name)
		}
	}
	slices.Sort(preempted)
	if !slices.Equal(preempted, []string{"w-1", "w-2"}) {
		t.Errorf("pods preempted: %v, want the two workers above the minimum (w-1, w-2)", preempted)
	}
	c.checkUntouched(ctx, t, ns, map[string]types.UID{"launcher": uids["launcher"], "w-0": uids["w-0"]})
	g := gs.get(ctx, t, ns, "job")
	if g.Annotations[gangv1.AnnotationCommitted] != id || !conditionStatus(g, gangv1.ConditionPlaced) {
		t.Errorf("the launcher's gang did not stay placed (placement %q, was %q):\n%s", g.Annotations[gangv1.AnnotationCommitted], id, describeConditions(g))
	}
	for _, b := range blockers {
		c.checkUntouched(ctx, t, ns, map[string]types.UID{b.Name: b.UID})
	}
	t.Logf("high gang runs on tray-b1; preempted %v; launcher and w-0 kept", preempted)
}

// elasticPodGroupGrows: the PodGroup API's elastic gang on the real
// scheduler. A pod holds two of tray-b1's four GPUs (clique B) when a
// PodGroup of minCount 2, annotated gang.tessera.dev/max-size: "4" (and
// managed: no domain claim), gets two gated one-GPU pods: its gang starts
// with them in the smallest domain that holds them, tray-b1. Two more pods
// join the group, gated: no room, so they wait and the running two are
// untouched (kube-scheduler's gang plugin holds a group's pods while one is
// gated only before the group is scheduled). When the blocker ends, the two
// join the placement on tray-b1 and the scheduler binds them.
func (e gangEnv) elasticPodGroupGrows(ctx context.Context, t *testing.T) {
	c, gs, client := e.c, e.gs, e.c.Client()
	const ns = "elastic-pg"
	blocker := c.halfOfTrayB1Held(ctx, t, ns)
	pg := &schedulingv1beta1.PodGroup{
		ObjectMeta: metav1.ObjectMeta{Name: "pg-el", Namespace: ns, Annotations: map[string]string{gangv1.AnnotationManaged: "true", gangv1.AnnotationMaxSize: "4"}},
		Spec:       schedulingv1beta1.PodGroupSpec{SchedulingPolicy: schedulingv1beta1.PodGroupSchedulingPolicy{Gang: &schedulingv1beta1.GangSchedulingPolicy{MinCount: 2}}},
	}
	noErr(t, ok(client.SchedulingV1beta1().PodGroups(ns).Create(ctx, pg, metav1.CreateOptions{})))
	t.Cleanup(func() {
		ctx := context.WithoutCancel(ctx)
		c.deleteGangPods(ctx, t, ns, "pg-el")
		noErr(t, client.SchedulingV1beta1().PodGroups(ns).Delete(ctx, "pg-el", metav1.DeleteOptions{}))
	})
	create := func(names ...string) {
		for _, name := range names {
			p := memberPod(ns, name, "pg-el", "one-gpu", "")
			p.Spec.SchedulingGroup = &corev1.PodSchedulingGroup{PodGroupName: ptr.To("pg-el")}
			noErr(t, ok(client.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{})))
		}
	}

	create("pg-el-0", "pg-el-1")
	started := c.waitNamedRunning(ctx, t, ns, 3*time.Minute, "pg-el-0", "pg-el-1")
	g := gs.waitCondition(ctx, t, ns, "pg-el", gangv1.ConditionRunning, metav1.ConditionTrue, time.Minute)
	id := g.Annotations[gangv1.AnnotationCommitted]
	if least, most := gangv1.Bounds(&g.Spec); least != 2 || most != 4 || g.Spec.PodGroupName != "pg-el" {
		t.Errorf("gang of the PodGroup: %+v, want 2 to 4 members of pg-el", g.Spec)
	}
	untouched := map[string]types.UID{}
	for name, p := range started {
		if p.Spec.NodeName != "tray-b1" || p.Annotations[gangv1.AnnotationPlacement] != id {
			t.Errorf("starting member %s: node %q, placement %q (gang's %q)", name, p.Spec.NodeName, p.Annotations[gangv1.AnnotationPlacement], id)
		}
		untouched[name] = p.UID
	}

	// Two more: no room on tray-b1, so they wait gated.
	create("pg-el-2", "pg-el-3")
	err := wait.PollUntilContextTimeout(ctx, 300*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		return gs.get(ctx, t, ns, "pg-el").Status.Members == 4, nil
	})
	noErr(t, err)
	for _, name := range []string{"pg-el-2", "pg-el-3"} {
		p, err := client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		noErr(t, err)
		if p.Spec.NodeName != "" || len(p.Spec.SchedulingGates) == 0 {
			t.Fatalf("member %s released while there is no room for it:\n%s", name, c.describePods(ctx, ns))
		}
	}
	c.checkUntouched(ctx, t, ns, untouched)

	c.deletePodsAndWait(ctx, t, blocker)
	for name, p := range c.waitNamedRunning(ctx, t, ns, 3*time.Minute, "pg-el-2", "pg-el-3") {
		if p.Spec.NodeName != "tray-b1" || p.Annotations[gangv1.AnnotationPlacement] != id {
			t.Errorf("joining member %s: node %q, placement %q (gang's %q)", name, p.Spec.NodeName, p.Annotations[gangv1.AnnotationPlacement], id)
		}
	}
	c.checkUntouched(ctx, t, ns, untouched)
	t.Logf("elastic PodGroup started with 2 on tray-b1 and grew to 4 in placement %s", id)
}
