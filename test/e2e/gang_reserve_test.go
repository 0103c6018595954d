package e2e

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/utils/ptr"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
)

// reservesAndBackfills: clique A's four trays are full with pods that
// declare no end; on clique B's tray, a pod of three GPUs runs with a 30 s
// deadline. A gang of two 2-GPU members (all at priority 0, so it preempts
// nothing) reserves tray-b1, which frees up first. Then, on the real
// scheduler with the chart's controller role and policies:
//   - a one-GPU pod without a toleration is not given tray-b1's free GPU
//     (the scheduler finds it unschedulable), nor are the one-GPU pods that
//     keep arriving every second until the gang runs;
//   - a backfill pod, whose claim tolerates gang.tessera.dev/reserved, runs
//     on it;
//   - at the reservation's start (the deadline), the backfill pod is
//     evicted, the deadline pod ends, and the gang runs on tray-b1.
func (e gangEnv) reservesAndBackfills(ctx context.Context, t *testing.T) {
	c, gs, client := e.c, e.gs, e.c.Client()
	const ns = "reserve"
	c.newNamespace(ctx, t, ns)
	backfill := gpuTemplate(ns, "one-gpu-backfill", 1)
	backfill.Spec.Spec.Devices.Requests[0].Exactly.Tolerations = []resourceapi.DeviceToleration{{
		Key: gangv1.TaintReserved, Operator: resourceapi.DeviceTolerationOpExists, Effect: resourceapi.DeviceTaintEffectNoSchedule}}
	// The members tolerate their reservation once it has started: the
	// controller hands it to them, keeping it until the scheduler has
	// allocated them all, so the pods that keep arriving cannot be
	// allocated the devices first.
	member := gpuTemplate(ns, "two-gpus-member", 2)
	member.Spec.Spec.Devices.Requests[0].Exactly.Tolerations = []resourceapi.DeviceToleration{{
		Key: gangv1.TaintReservationStarted, Operator: resourceapi.DeviceTolerationOpExists, Effect: resourceapi.DeviceTaintEffectNoSchedule}}
	c.createTemplates(ctx, t, gpuTemplate(ns, "one-gpu", 1), gpuTemplate(ns, "two-gpus", 2), gpuTemplate(ns, "three-gpus", 3), gpuTemplate(ns, "four-gpus", 4), backfill, member)
	var blockers []*corev1.Pod
	t.Cleanup(func() { c.deletePodsAndWait(context.WithoutCancel(ctx), t, blockers...) })
	for _, tray := range []string{"tray-a1", "tray-a2", "tray-a3", "tray-a4"} {
		blockers = append(blockers, c.createAndRun(ctx, t, onNode(newGPUPod(ns, "forever-"+tray, gpuFrom("four-gpus")), tray)))
	}
	ending := onNode(newGPUPod(ns, "ending", gpuFrom("three-gpus")), "tray-b1")
	ending.Spec.ActiveDeadlineSeconds = ptr.To[int64](30)
	ending = c.createAndRun(ctx, t, ending)
	blockers = append(blockers, ending)

	noErr(t, ok(client.ResourceV1().ResourceClaims(ns).Create(ctx, domainClaim(ns, "big-domain"), metav1.CreateOptions{})))
	t.Cleanup(func() { c.deleteGangAndMembers(context.WithoutCancel(ctx), t, gs, ns, "big") })
	gs.create(ctx, t, labelGang(ns, "big", 2, "big-domain"))
	c.createMembers(ctx, t, ns, "big", "two-gpus-member", "big-domain", 2)
	var g *gangv1.Gang
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		g = gs.get(ctx, t, ns, "big")
		return conditionReason(g, gangv1.ConditionWaiting) == gangv1.ReasonReserved, nil
	})
	if err != nil {
		t.Fatalf("gang not reserving:\n%s", describeConditions(g))
	}
	r := g.Status.Reservation
	if r == nil || r.Domain != poolB || !slices.Equal(r.Nodes, []string{"tray-b1"}) || !slices.Equal(r.WaitingFor, []string{ns + "/ending"}) {
		t.Fatalf("reservation %+v, want tray-b1 of %s waiting for %s/ending", r, poolB, ns)
	}
	if want := ending.Status.StartTime.Add(30 * time.Second); r.Start.Time.Before(want.Add(-time.Second)) || r.Start.Time.After(want.Add(time.Second)) {
		t.Errorf("reservation starts at %s, want the deadline pod's end %s", r.Start.Time, want)
	}
	t.Logf("reserved: %s", conditionMessageOf(g, gangv1.ConditionWaiting))

	// New work without a toleration is kept off the free GPU...
	small := onNode(newGPUPod(ns, "small", gpuFrom("one-gpu")), "tray-b1")
	noErr(t, ok(client.CoreV1().Pods(ns).Create(ctx, small, metav1.CreateOptions{})))
	blockers = append(blockers, small)
	c.waitForPod(ctx, t, ns, "small", "unschedulable", time.Minute, func(p *corev1.Pod) bool {
		for _, cond := range p.Status.Conditions {
			if cond.Type == corev1.PodScheduled && cond.Status == corev1.ConditionFalse && cond.Reason == corev1.PodReasonUnschedulable {
				return true
			}
		}
		return false
	})
	// ...while a backfill pod runs there.
	bf := c.createAndRun(ctx, t, onNode(newGPUPod(ns, "backfill", gpuFrom("one-gpu-backfill")), "tray-b1"))
	blockers = append(blockers, bf)
	if time.Now().After(r.Start.Time) {
		t.Fatalf("the backfill pod started after the reservation's start (%s): the test is too slow to show backfill", r.Start.Time)
	}

	// One-GPU pods keep arriving until the gang runs.
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var stream []*corev1.Pod
	var streamErr error
	wg.Go(func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-time.After(time.Second):
			}
			p, err := client.CoreV1().Pods(ns).Create(ctx, newGPUPod(ns, fmt.Sprintf("stream-%d", i), gpuFrom("one-gpu")), metav1.CreateOptions{})
			if err != nil {
				streamErr = err
				return
			}
			stream = append(stream, p)
		}
	})
	pods := c.waitAllRunning(ctx, t, ns, "gang=big", 2, 2*time.Minute)
	close(stop)
	wg.Wait()
	blockers = append(blockers, stream...)
	noErr(t, streamErr)
	for _, p := range pods {
		if p.Spec.NodeName != "tray-b1" {
			t.Errorf("member %s runs on %s, want the reserved tray-b1", p.Name, p.Spec.NodeName)
		}
	}
	g = gs.get(ctx, t, ns, "big")
	if g.Status.Reservation != nil {
		t.Errorf("the placed gang still holds its reservation: %+v", g.Status.Reservation)
	}
	if rules, err := client.ResourceV1().DeviceTaintRules().List(ctx, metav1.ListOptions{LabelSelector: gangv1.LabelReservation}); err != nil || len(rules.Items) != 0 {
		t.Errorf("reservation rules left after the placement: %v %+v", err, rules)
	}
	// The backfill pod was evicted at the start; no pod without a
	// toleration ever ran on tray-b1 before the gang.
	if !c.hasEventOf(ctx, ns, "Pod", "backfill", gangv1.ReasonBackfillEvicted) {
		t.Errorf("no %s event on the backfill pod; events:\n%s", gangv1.ReasonBackfillEvicted, c.events(ctx, ns))
	}
	for _, p := range append([]*corev1.Pod{small}, stream...) {
		got, err := client.CoreV1().Pods(ns).Get(ctx, p.Name, metav1.GetOptions{})
		if err == nil && got.Spec.NodeName != "" {
			t.Errorf("pod %s without a toleration was bound to %s while the gang waited", p.Name, got.Spec.NodeName)
		}
	}
	t.Logf("gang runs on tray-b1; %d one-GPU pods arrived meanwhile and wait", len(stream)+1)
}
