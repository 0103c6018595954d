package e2e

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	schedulingv1 "k8s.io/api/scheduling/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/utils/ptr"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
)

// priorityClasses creates PriorityClasses of these values, named
// tessera-e2e-<value>, deleted at t's end.
func (c *tesseraCluster) priorityClasses(ctx context.Context, t *testing.T, values ...int32) {
	t.Helper()
	for _, v := range values {
		name := fmt.Sprintf("tessera-e2e-%d", v)
		pc := &schedulingv1.PriorityClass{ObjectMeta: metav1.ObjectMeta{Name: name}, Value: v}
		if _, err := c.Client().SchedulingV1().PriorityClasses().Create(ctx, pc, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			_ = c.Client().SchedulingV1().PriorityClasses().Delete(context.WithoutCancel(ctx), name, metav1.DeleteOptions{})
		})
	}
}

// neverPreemptingClass makes a PriorityClass of that value whose pods never
// preempt, deleted at t's end.
func (c *tesseraCluster) neverPreemptingClass(ctx context.Context, t *testing.T, name string, value int32) {
	t.Helper()
	pc := &schedulingv1.PriorityClass{ObjectMeta: metav1.ObjectMeta{Name: name}, Value: value, PreemptionPolicy: ptr.To(corev1.PreemptNever)}
	if _, err := c.Client().SchedulingV1().PriorityClasses().Create(ctx, pc, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = c.Client().SchedulingV1().PriorityClasses().Delete(context.WithoutCancel(ctx), name, metav1.DeleteOptions{})
	})
}

// preemptsAWholeGang: clique A's four trays are each full with a pod of
// priority 500, and a gang of priority 100 (two members of two GPUs) fills
// clique B's tray. A gang of priority 1000 (two members of one GPU) fits
// nowhere; evicting one member of the low gang would make room, as would one
// pod of clique A. The gang takes the cheapest whole unit in one domain: both
// members of the low gang (the lowest priority), through the Eviction API,
// and nothing else; it then runs in clique B. Everything runs under the
// chart's controller role and admission policies (the controller lists
// PodDisruptionBudgets with it).
func (e gangEnv) preemptsAWholeGang(ctx context.Context, t *testing.T) {
	c, gs, client := e.c, e.gs, e.c.Client()
	const ns = "preempt"
	c.newNamespace(ctx, t, ns)
	c.priorityClasses(ctx, t, 100, 500, 1000)
	c.createTemplates(ctx, t, gpuTemplate(ns, "one-gpu", 1), gpuTemplate(ns, "two-gpus", 2), gpuTemplate(ns, "four-gpus", 4))
	prioritised := func(p *corev1.Pod, value int32) *corev1.Pod {
		p.Spec.PriorityClassName = fmt.Sprintf("tessera-e2e-%d", value)
		return p
	}
	// Clique A full with pods of priority 500.
	mid := map[string]types.UID{}
	var blockers []*corev1.Pod
	for _, tray := range []string{"tray-a1", "tray-a2", "tray-a3", "tray-a4"} {
		p := c.createAndRun(ctx, t, prioritised(onNode(newGPUPod(ns, "mid-"+tray, gpuFrom("four-gpus")), tray), 500))
		mid[p.Name] = p.UID
		blockers = append(blockers, p)
	}
	t.Cleanup(func() { c.deletePodsAndWait(context.WithoutCancel(ctx), t, blockers...) })

	// The low gang fills clique B.
	for _, name := range []string{"low", "high"} {
		noErr(t, ok(client.ResourceV1().ResourceClaims(ns).Create(ctx, domainClaim(ns, name+"-domain"), metav1.CreateOptions{})))
		t.Cleanup(func() { c.deleteGangAndMembers(context.WithoutCancel(ctx), t, gs, ns, name) })
	}
	gs.create(ctx, t, labelGang(ns, "low", 2, "low-domain"))
	low := map[string]types.UID{}
	for i := range 2 {
		p := prioritised(memberPod(ns, fmt.Sprintf("low-%d", i), "low", "two-gpus", "low-domain"), 100)
		noErr(t, ok(client.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{})))
	}
	for _, p := range c.waitAllRunning(ctx, t, ns, "gang=low", 2, 3*time.Minute) {
		if p.Spec.NodeName != "tray-b1" {
			t.Fatalf("low member %s runs on %s, want tray-b1 (clique B)", p.Name, p.Spec.NodeName)
		}
		low[p.Name] = p.UID
	}

	// The high gang preempts the whole low gang, and only it.
	gs.create(ctx, t, labelGang(ns, "high", 2, "high-domain"))
	for i := range 2 {
		p := prioritised(memberPod(ns, fmt.Sprintf("high-%d", i), "high", "one-gpu", "high-domain"), 1000)
		noErr(t, ok(client.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{})))
	}
	began := time.Now()
	pods := c.waitAllRunning(ctx, t, ns, "gang=high", 2, 3*time.Minute)
	ran := time.Since(began)
	for _, p := range pods {
		if p.Spec.NodeName != "tray-b1" {
			t.Errorf("high member %s runs on %s, want tray-b1, freed by the preemption", p.Name, p.Spec.NodeName)
		}
	}
	g := gs.waitCondition(ctx, t, ns, "high", gangv1.ConditionRunning, metav1.ConditionTrue, time.Minute)
	if g.Status.Preemption != nil {
		t.Errorf("the placed gang still holds a preemption: %+v", g.Status.Preemption)
	}
	if !c.hasEvent(ctx, ns, "high", gangv1.ReasonPreempting) {
		t.Errorf("no %s event on the high gang; events:\n%s", gangv1.ReasonPreempting, c.events(ctx, ns))
	}
	// Exactly the low gang's members were preempted, each through the
	// Eviction API (the kubelet marks them DisruptionTarget)...
	var preempted []string
	list, err := client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{})
	noErr(t, err)
	for _, ev := range list.Items {
		if ev.Reason == gangv1.ReasonPreempted && ev.InvolvedObject.Kind == "Pod" {
			preempted = append(preempted, ev.InvolvedObject.Name)
		}
	}
	sort.Strings(preempted)
	if preempted = slices.Compact(preempted); !slices.Equal(preempted, []string{"low-0", "low-1"}) {
		t.Errorf("pods preempted: %v, want the low gang's two members", preempted)
	}
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		for name, uid := range low {
			p, err := client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
			if err == nil && p.UID == uid {
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		t.Errorf("a low member outlived the preemption: %v", err)
	}
	// ...and every pod of clique A still runs, never deleted.
	for name, uid := range mid {
		p, err := client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil || p.UID != uid || p.DeletionTimestamp != nil || p.Status.Phase != corev1.PodRunning {
			t.Errorf("pod %s of priority 500 in clique A was touched: %v %+v", name, err, p.Status.Phase)
		}
	}
	// The low gang waits for its workload to recreate its members.
	if lg := gs.get(ctx, t, ns, "low"); conditionStatus(lg, gangv1.ConditionPlaced) {
		t.Errorf("the low gang still counts as placed:\n%s", describeConditions(lg))
	}
	t.Logf("high gang running on tray-b1 %s after its members were created; preempted %v", ran.Round(100*time.Millisecond), preempted)
}
