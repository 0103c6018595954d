package e2e

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/utils/ptr"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/controller/gang"
	"github.com/tessera-dev/tessera/driver/domain"
	"github.com/tessera-dev/tessera/test/gpunode"
)

// This file holds TestGangPlacement's race of a gang against a stream of
// small pods for one clique: real concurrency, no hook, and assertions that
// hold whatever the interleaving.

// streamNodes are the trays of clique A, where the small pods go; a blocker
// takes two GPUs of tray-a1, so the clique has 14 GPUs left for a gang of 8
// and the stream.
var streamNodes = []string{"tray-a1", "tray-a2", "tray-a3", "tray-a4"}

const (
	streamGangSize = 8
	// streamCreators create and delete small pods concurrently; the first
	// asks for a 1g MIG partition, the others for a whole GPU.
	streamCreators = 4
	// smallPodWait: how long a creator waits for its pod to run before it
	// deletes it anyway (the clique may be full).
	smallPodWait = 20 * time.Second
	// streamCap bounds the stream: it stops this long after the gang was
	// created if the gang has not run whole before.
	streamCap = 60 * time.Second
)

// churnTrials is how many trials smallPodStream runs:
// TESSERA_CHURN_TRIALS, 1 by default (make churn runs more).
func churnTrials(t *testing.T) int {
	v := os.Getenv("TESSERA_CHURN_TRIALS")
	if v == "" {
		return 1
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		t.Fatalf("TESSERA_CHURN_TRIALS=%q: want a positive number of trials", v)
	}
	return n
}

// churnFirst is the first trial's number: TESSERA_CHURN_FIRST, 0 by
// default (to run again a trial that failed, with its kill and shape).
func churnFirst(t *testing.T) int {
	v := os.Getenv("TESSERA_CHURN_FIRST")
	if v == "" {
		return 0
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 {
		t.Fatalf("TESSERA_CHURN_FIRST=%q: want a trial number, 0 or more", v)
	}
	return n
}

// churnKills are the steps at which a trial kills the controller, in turn
// (none first): a crash between the search and the commit (the restarted
// controller rolls the placement back), between the commit and the
// release, and while the members wait to bind.
var churnKills = []string{"", gang.StepClaimWritten, gang.StepCommit, gang.StepRelease, gang.StepBind}

// churnShape is the kind of gang a trial places, in turn with the kills
// (five kills and three shapes: every pairing within 15 trials).
type churnShape string

const (
	// shapeFixed: a gang of exactly 8.
	shapeFixed churnShape = "fixed"
	// shapeElastic: minSize 4, maxSize 8, in a domain of at least 8 GPUs:
	// it starts with what fits of the clique beside the stream and grows as
	// small pods end.
	shapeElastic churnShape = "elastic"
	// shapePreempt: a gang of 7 of priority 100 runs in the clique first,
	// leaving 7 GPUs for the stream and the gang of 8 of priority 1000; the
	// blocker and the small pods have 500 (and never preempt), so the gang
	// runs only by preempting: the low gang, whole (the cheapest victims).
	shapePreempt churnShape = "preempt"
)

var churnShapes = []churnShape{shapeFixed, shapeElastic, shapePreempt}

// Priorities of the preempt shape's pods (PriorityClasses tessera-e2e-<n>;
// the small pods' class never preempts).
const (
	lowGangPriority   = 100
	smallPodPriority  = 500
	trainGangPriority = 1000
	lowGangSize       = 7
)

// smallPodStream runs churn trials (churnTrials): in each, a gang of 8
// one-GPU members of an indexed Job is created while four goroutines keep
// creating and deleting small pods (whole GPUs and 1g partitions) on the
// same clique, whose 14 free GPUs are a little more than both need, and the
// controller is killed at one step of the placement (churnKills, in turn)
// and started again; the gang is of fixed size, elastic or preempting
// (churnShapes, in turn). The scheduler allocates the small pods' claims and the
// members', the controller only the gang's channel. Watched event by event,
// with the test's own ledger of the published slices:
//   - no device (a GPU, a partition, a GPU and one of its partitions, a
//     channel) is allocated to two claims at any instant;
//   - no pod is refused at prepare for a device another claim holds;
//   - fewer members than the gang's least (its size, or an elastic gang's
//     minSize) run while others do not only for the start skew: they bind
//     together;
//   - a gang that waits with no placement in progress holds nothing;
//   - a small pod bound to a node ran (or was deleted when the stream
//     stopped); a member bound ran;
//   - once the stream stops, the gang runs whole in clique A.
func (e gangEnv) smallPodStream(ctx context.Context, t *testing.T) {
	first := churnFirst(t)
	for trial := first; trial < first+churnTrials(t); trial++ {
		kill := churnKills[trial%len(churnKills)]
		shape := churnShapes[trial%len(churnShapes)]
		name := fmt.Sprintf("trial-%d-%s", trial, shape)
		if kill != "" {
			name += "-kill-at-" + kill
		}
		if !t.Run(name, func(t *testing.T) {
			e.c.LogsOnFailure(t)
			e.streamTrial(ctx, t, fmt.Sprintf("stream-%d", trial), kill, shape)
		}) {
			return
		}
	}
}

// streamTrial is one trial of smallPodStream in namespace ns, killing the
// controller at step kill ("": not at all), with a gang of that shape.
func (e gangEnv) streamTrial(ctx context.Context, t *testing.T, ns, kill string, shape churnShape) {
	e.setUp(ctx, t, ns)
	client := e.c.Client()
	e.c.createTemplates(ctx, t, gpuTemplate(ns, "two-gpus", 2), migTemplate(ns, "one-slice", "1g.23gb"))
	// prioritised gives a pod the preempt shape's priority (nothing in the
	// other shapes).
	prioritised := func(p *corev1.Pod, class string) *corev1.Pod {
		if shape == shapePreempt {
			p.Spec.PriorityClassName = class
		}
		return p
	}
	smallClass := fmt.Sprintf("tessera-e2e-%d-never", smallPodPriority)
	if shape == shapePreempt {
		e.c.priorityClasses(ctx, t, lowGangPriority, trainGangPriority)
		e.c.neverPreemptingClass(ctx, t, smallClass, smallPodPriority)
	}
	blocker := e.c.createAndRun(ctx, t, prioritised(onNode(newGPUPod(ns, "blocker", gpuFrom("two-gpus")), "tray-a1"), smallClass))

	const skew = 30 * time.Second
	least := streamGangSize
	if shape == shapeElastic {
		least = streamGangSize / 2
	}
	w := newRaceWatch(client, e.gs.dyn, "train", streamGangSize, least, skew)
	wctx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	w.start(wctx, t, e.gs.dyn, ns)
	// The ledger's check needs a free GPU on tray-a1 (its partitions are
	// published): before the low gang fills the clique.
	checkLedger(ctx, t, e.c, streamNodes[0])
	if shape == shapePreempt {
		e.runLowGang(ctx, t, ns)
	}

	s := &smallStream{c: e.c, w: w, ns: ns, stop: make(chan struct{})}
	if shape == shapePreempt {
		s.class = smallClass
	}
	var wg sync.WaitGroup
	errs := make([]error, streamCreators)
	for i := range streamCreators {
		claim := gpuFrom("one-gpu")
		if i == 0 {
			claim = corev1.PodResourceClaim{Name: "mig", ResourceClaimTemplateName: ptr.To("one-slice")}
		}
		wg.Go(func() {
			if errs[i] = s.create(ctx, i, claim); errs[i] != nil {
				s.failed.Store(true)
			}
		})
	}
	stopStream := sync.OnceFunc(func() { close(s.stop); wg.Wait() })
	defer stopStream()
	isSmall := func(p *corev1.Pod) bool { return p.Labels["role"] == "small" }
	eventually(ctx, t, time.Minute, "four small pods ran before the gang", func() bool {
		return s.failed.Load() || w.count(func(p *corev1.Pod, ran bool) bool { return isSmall(p) && ran }) >= 4
	})
	if s.failed.Load() {
		stopStream()
		t.Fatalf("the stream of small pods: %v", errors.Join(errs...))
	}

	// The controller that dies at the kill step, once.
	var killed atomic.Bool
	var dying *runningController
	if kill != "" {
		dying = e.restartController(t, func(step string) bool { return step == kill && !killed.Swap(true) })
	}
	// An elastic gang may start in any domain with room for its minimum,
	// and grows only there: its domain claim asks for one that can hold
	// all eight (clique A; clique B's one tray has four GPUs).
	domainName := "g-domain"
	if shape == shapeElastic {
		domainName = "whole-domain"
		noErr(t, ok(client.ResourceV1().ResourceClaims(ns).Create(ctx, domainClaim(ns, domainName,
			fmt.Sprintf(`device.attributes["%s"].%s >= %d`, gpunode.DriverName, domain.AttrGPUs, streamGangSize)), metav1.CreateOptions{})))
	}
	began, before := time.Now(), s.created.Load()
	train := &gangv1.Gang{
		ObjectMeta: metav1.ObjectMeta{Name: "train", Namespace: ns},
		Spec: gangv1.GangSpec{Size: streamGangSize, DomainClaimName: domainName,
			Selector: metav1.LabelSelector{MatchLabels: map[string]string{jobName: "train"}}},
	}
	if shape == shapeElastic {
		train.Spec.Size, train.Spec.MinSize, train.Spec.MaxSize = 0, int32(least), streamGangSize
	}
	e.gs.create(ctx, t, train)
	// A member lost evicts all eight members at once. The Job controller's
	// pod-failure backoff counts them all, even the evictions its
	// podFailurePolicy ignores: 10 s doubled per failure, up to 10 minutes
	// before it recreates any. Per-index limits back off each index on its
	// own failures (one each), as docs/gang.md advises for gangs of Jobs.
	job := indexedJob(ns, "train", streamGangSize, "one-gpu", domainName)
	job.Spec.BackoffLimitPerIndex = ptr.To(int32(100))
	if shape == shapePreempt {
		job.Spec.Template.Spec.PriorityClassName = fmt.Sprintf("tessera-e2e-%d", trainGangPriority)
	}
	noErr(t, ok(client.BatchV1().Jobs(ns).Create(ctx, job, metav1.CreateOptions{})))
	if dying != nil {
		select {
		case <-dying.done:
		case <-time.After(2 * time.Minute):
			t.Fatalf("the controller was not killed at %s", kill)
		}
		*e.ctl = startController(e.parent, e.kubeconfig, "", nil)
	}

	// The stream runs until the gang has run whole and four more small pods
	// were created beside it, or for streamCap.
	var wholeAfter time.Duration
	var during int32
	_ = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, streamCap, true, func(context.Context) (bool, error) {
		if wholeAfter == 0 && w.isWhole() {
			wholeAfter, during = time.Since(began), s.created.Load()-before
		}
		return s.failed.Load() || wholeAfter > 0 && s.created.Load()-before-during >= 4, nil
	})
	stopStream()
	total := s.created.Load() - before
	if err := errors.Join(errs...); err != nil {
		t.Fatalf("the stream of small pods: %v", err)
	}
	streamed := time.Since(began)
	if wholeAfter == 0 {
		during = total
	}
	if during == 0 {
		t.Fatal("no small pod was created while the gang was being placed: the test raced nothing")
	}
	e.deleteSmallPods(ctx, t, ns)

	// The gang ends whole in clique A.
	pods, g := e.waitWhole(ctx, t, ns, "train", streamGangSize)
	checkPlacedIn(ctx, t, e.c, ns, g, pods, streamNodes)
	stopWatch()

	r := w.report()
	for _, f := range r.failures {
		t.Error(f)
	}
	for _, refusal := range e.c.refusedForAHeldDevice(ctx, t, ns) {
		t.Errorf("refused at prepare for a device another claim holds: %s", refusal)
	}
	var smallCreated, smallRan, smallUnbound, smallAbandoned int
	for uid, p := range r.pods {
		switch {
		case isSmall(p):
			smallCreated++
			switch {
			case r.ran[uid]:
				smallRan++
			case !r.bound[uid]:
				smallUnbound++
			case s.abandoned(p.Name):
				smallAbandoned++
			default:
				t.Errorf("small pod %s was bound to %s and never ran", p.Name, p.Spec.NodeName)
			}
		case p.Labels[jobName] == "train" && r.bound[uid] && !r.ran[uid] && p.DeletionTimestamp == nil:
			t.Errorf("member %s was bound to %s and never ran", p.Name, p.Spec.NodeName)
		}
	}
	if r.waitingLooks == 0 && wholeAfter == 0 {
		t.Errorf("the gang never ran whole during the stream, and never waited holding nothing either")
	}
	var clashes []string
	for _, c := range r.clashes {
		clashes = append(clashes, fmt.Sprintf("%s for %v", c.String(), c.lasted.Round(10*time.Millisecond)))
	}
	t.Logf("stream of %d small pods (%d ran, %d never bound: the clique was full, %d deleted bound when the stream stopped), %d created while the gang was placed, %d after it ran whole in %v; stream stopped after %v",
		smallCreated, smallRan, smallUnbound, smallAbandoned, during, total-during, wholeAfter.Round(100*time.Millisecond), streamed.Round(100*time.Millisecond))
	t.Logf("controller killed at %q; %d looks at the claims and pods, %d at a waiting gang; members ran split for at most %v; %d overlaps: %v; placement %s on %v",
		kill, r.looks, r.waitingLooks, r.longestSplit.Round(10*time.Millisecond), len(r.clashes), clashes, g.Annotations[gangv1.AnnotationCommitted], g.Status.Nodes)
	t.Logf("gang events:\n%s", gangEvents(ctx, e.c, ns))

	switch shape {
	case shapeElastic:
		t.Logf("elastic gang grew: %v", e.c.hasEvent(ctx, ns, "train", gangv1.ReasonGrown))
	case shapePreempt:
		var preempted []string
		for _, p := range r.pods {
			if p.Labels["gang"] == "low" && e.c.hasEventOf(ctx, ns, "Pod", p.Name, gangv1.ReasonPreempted) {
				preempted = append(preempted, p.Name)
			}
		}
		slices.Sort(preempted)
		if len(preempted) != lowGangSize {
			t.Errorf("the low gang's members preempted: %v, want all %d", preempted, lowGangSize)
		}
		t.Logf("the gang preempted the low gang's %v", preempted)
		e.c.deleteGangAndMembers(ctx, t, e.gs, ns, "low")
	}

	// Leave the clique free for the next trial.
	e.c.deleteJob(ctx, t, ns, "train")
	e.gs.delete(ctx, t, ns, "train")
	e.c.deletePodsAndWait(ctx, t, blocker)
}

// runLowGang runs the preempt shape's low gang: lowGangSize one-GPU
// members of priority lowGangPriority with their own domain claim, in
// clique A (clique B's tray has four GPUs).
func (e gangEnv) runLowGang(ctx context.Context, t *testing.T, ns string) {
	t.Helper()
	client := e.c.Client()
	noErr(t, ok(client.ResourceV1().ResourceClaims(ns).Create(ctx, domainClaim(ns, "low-domain"), metav1.CreateOptions{})))
	e.gs.create(ctx, t, labelGang(ns, "low", lowGangSize, "low-domain"))
	var names []string
	for i := range lowGangSize {
		p := memberPod(ns, fmt.Sprintf("low-%d", i), "low", "one-gpu", "low-domain")
		p.Spec.PriorityClassName = fmt.Sprintf("tessera-e2e-%d", lowGangPriority)
		noErr(t, ok(client.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{})))
		names = append(names, p.Name)
	}
	for _, p := range e.c.waitNamedRunning(ctx, t, ns, 3*time.Minute, names...) {
		if !slices.Contains(streamNodes, p.Spec.NodeName) {
			t.Fatalf("low gang member %s runs on %s, want clique A %v", p.Name, p.Spec.NodeName, streamNodes)
		}
	}
}

// smallStream creates and deletes small pods on streamNodes until stop.
type smallStream struct {
	c    *tesseraCluster
	w    *raceWatch
	ns   string
	stop chan struct{}
	// class is the small pods' PriorityClass ("": none).
	class   string
	created atomic.Int32
	// failed: a creator stopped on an error.
	failed atomic.Bool
	// left: pods deleted before they could run because the stream stopped.
	left sync.Map
}

// abandoned says whether the stream deleted the pod because it stopped.
func (s *smallStream) abandoned(name string) bool {
	_, ok := s.left.Load(name)
	return ok
}

// create is one creator: it creates a pod, waits until it runs (at most
// smallPodWait), deletes it and starts the next, until the stream stops.
func (s *smallStream) create(ctx context.Context, id int, claim corev1.PodResourceClaim) error {
	pods := s.c.Client().CoreV1().Pods(s.ns)
	for n := 0; ; n++ {
		select {
		case <-s.stop:
			return nil
		default:
		}
		pod := onNodes(newGPUPod(s.ns, fmt.Sprintf("small-%d-%d", id, n), claim), streamNodes...)
		pod.Labels = map[string]string{"role": "small"}
		pod.Spec.PriorityClassName = s.class
		if _, err := pods.Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("create small pod %s: %w", pod.Name, err)
		}
		s.created.Add(1)
		_ = wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, smallPodWait, true, func(context.Context) (bool, error) {
			if p := s.w.pod(pod.Name); p != nil && p.Status.Phase == corev1.PodRunning {
				return true, nil
			}
			select {
			case <-s.stop:
				s.left.Store(pod.Name, true)
				return true, nil
			default:
				return false, nil
			}
		})
		if err := pods.Delete(ctx, pod.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete small pod %s: %w", pod.Name, err)
		}
	}
}

// deleteSmallPods deletes what the stream left and waits until it is gone.
func (e gangEnv) deleteSmallPods(ctx context.Context, t *testing.T, ns string) {
	t.Helper()
	pods := e.c.Client().CoreV1().Pods(ns)
	noErr(t, pods.DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{LabelSelector: "role=small"}))
	eventually(ctx, t, 2*time.Minute, "the small pods gone", func() bool {
		list, err := pods.List(ctx, metav1.ListOptions{LabelSelector: "role=small"})
		return err == nil && len(list.Items) == 0
	})
}

// waitWhole waits until the gang's committed placement runs whole: size
// live members of the Job, all running with that placement, and the gang's
// Running condition true.
func (e gangEnv) waitWhole(ctx context.Context, t *testing.T, ns, name string, size int) ([]corev1.Pod, *gangv1.Gang) {
	t.Helper()
	var g *gangv1.Gang
	var pods []corev1.Pod
	// Bounded by the Job controller's backoff after a repair (see the Job
	// above), not by the gang controller.
	// The reads use the test's context, not the poll's, whose deadline
	// would fail them before the report below says why.
	err := wait.PollUntilContextTimeout(ctx, 300*time.Millisecond, 6*time.Minute, true, func(context.Context) (bool, error) {
		g = e.gs.get(ctx, t, ns, name)
		id := g.Annotations[gangv1.AnnotationCommitted]
		list, err := e.c.Client().CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: jobName + "=" + name})
		if err != nil || id == "" {
			return false, nil
		}
		pods = pods[:0]
		for _, p := range list.Items {
			if p.DeletionTimestamp != nil {
				return false, nil
			}
			if p.Status.Phase == corev1.PodRunning && p.Annotations[gangv1.AnnotationPlacement] == id {
				pods = append(pods, p)
			}
		}
		return len(list.Items) == size && len(pods) == size && conditionStatus(g, gangv1.ConditionRunning), nil
	})
	if err != nil {
		list, _ := e.c.Client().CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: jobName + "=" + name})
		var b strings.Builder
		for _, p := range list.Items {
			fmt.Fprintf(&b, "  pod %s: %s node=%q placement=%q deleting=%v\n", p.Name, p.Status.Phase, p.Spec.NodeName, p.Annotations[gangv1.AnnotationPlacement], p.DeletionTimestamp != nil)
		}
		t.Fatalf("gang %s/%s does not run whole:\n%s%sevents:\n%s", ns, name, describeConditions(g), b.String(), e.c.events(ctx, ns))
	}
	return pods, g
}

// checkPlacedIn checks that every member runs on one of the nodes with one
// GPU of its node, and that the domain claim is a channel of clique A
// reserved for the members.
func checkPlacedIn(ctx context.Context, t *testing.T, c *tesseraCluster, ns string, g *gangv1.Gang, pods []corev1.Pod, nodes []string) {
	t.Helper()
	for i := range pods {
		p := &pods[i]
		claim := c.claimOf(ctx, t, p, "gpu")
		if !slices.Contains(nodes, p.Spec.NodeName) || len(allocatedDevices(claim)) != 1 {
			t.Errorf("member %s runs on %s with %v, want one GPU on one of %v", p.Name, p.Spec.NodeName, allocatedDevices(claim), nodes)
		}
	}
	dc := getClaim(ctx, t, c, ns, g.Spec.DomainClaimName)
	if a := dc.Status.Allocation; a == nil || len(a.Devices.Results) != 1 || a.Devices.Results[0].Pool != poolA || len(dc.Status.ReservedFor) != len(pods) {
		t.Errorf("domain claim %s: allocation %+v reserved for %d pods, want one channel of %s for %d", dc.Name, dc.Status.Allocation, len(dc.Status.ReservedFor), poolA, len(pods))
	}
	if !strings.HasPrefix(g.Status.Domain, poolA+"/") {
		t.Errorf("gang placed in %q, want clique A (%s)", g.Status.Domain, poolA)
	}
}

// checkLedger shows the ledger's verdicts on the node's real slices: a whole
// GPU clashes with one of its partitions and with itself, not with another
// GPU, and two partitions of one GPU on distinct slices do not clash.
func checkLedger(ctx context.Context, t *testing.T, c *tesseraCluster, node string) {
	t.Helper()
	// The GPU whose partitions the node publishes (lazy publishing keeps
	// the others' back, and publishes a spare's again a moment after the
	// last trial's pods ended): waited for.
	var l *ledger
	pool, gpu := "", ""
	eventually(ctx, t, time.Minute, "node "+node+" publishes the partitions of a free GPU", func() bool {
		list, err := c.Client().ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false
		}
		var all []*resourceapi.ResourceSlice
		for i := range list.Items {
			all = append(all, &list.Items[i])
			if list.Items[i].Spec.NodeName != nil && *list.Items[i].Spec.NodeName == node {
				pool = list.Items[i].Spec.Pool.Name
			}
		}
		l = newLedger(all)
		gpu = ""
		for id := range l.devices {
			if d, ok := strings.CutPrefix(id, gpunode.DriverName+"/"+pool+"/"); ok && strings.HasSuffix(d, "-mig-1g23gb-6") {
				gpu = strings.TrimSuffix(d, "-mig-1g23gb-6")
			}
		}
		for _, part := range []string{"", "-mig-1g23gb-0", "-mig-2g47gb-0"} {
			if _, ok := l.devices[gpunode.DriverName+"/"+pool+"/"+gpu+part]; gpu == "" || !ok {
				return false
			}
		}
		return true
	})
	other := "gpu-0"
	if gpu == "gpu-0" {
		other = "gpu-1"
	}
	claim := func(name string, devices ...string) *resourceapi.ResourceClaim {
		rc := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "ledger", Name: name}}
		rc.Status.Allocation = &resourceapi.AllocationResult{}
		for _, d := range devices {
			rc.Status.Allocation.Devices.Results = append(rc.Status.Allocation.Devices.Results, resourceapi.DeviceRequestAllocationResult{Driver: gpunode.DriverName, Pool: pool, Device: d})
		}
		return rc
	}
	for _, tc := range []struct {
		a, b  string
		clash bool
	}{
		{gpu, gpu, true},
		{gpu, gpu + "-mig-1g23gb-6", true},
		{gpu, other, false},
		{gpu + "-mig-1g23gb-0", gpu + "-mig-1g23gb-6", false},
		{gpu + "-mig-1g23gb-0", gpu + "-mig-2g47gb-0", true},
	} {
		for _, d := range []string{tc.a, tc.b} {
			if _, ok := l.devices[gpunode.DriverName+"/"+pool+"/"+d]; !ok {
				t.Fatalf("ledger: node %s (pool %q) publishes no device %s", node, pool, d)
			}
		}
		if got := l.clashes([]*resourceapi.ResourceClaim{claim("a", tc.a), claim("b", tc.b)}); (len(got) > 0) != tc.clash {
			t.Fatalf("ledger: claims of %s and %s clash: %v, want %v", tc.a, tc.b, got, tc.clash)
		}
	}
}

// onNodes confines a pod to the nodes through the scheduler (node
// affinity: one term per node, as a field selector takes one name), so that
// its claims are still allocated by the scheduler.
func onNodes(pod *corev1.Pod, nodes ...string) *corev1.Pod {
	var terms []corev1.NodeSelectorTerm
	for _, n := range nodes {
		terms = append(terms, corev1.NodeSelectorTerm{
			MatchFields: []corev1.NodeSelectorRequirement{{Key: "metadata.name", Operator: corev1.NodeSelectorOpIn, Values: []string{n}}},
		})
	}
	pod.Spec.Affinity = &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{
		RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{NodeSelectorTerms: terms},
	}}
	return pod
}

// gangEvents lists the namespace's events about gangs.
func gangEvents(ctx context.Context, c *tesseraCluster, ns string) string {
	list, err := c.Client().CoreV1().Events(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return err.Error()
	}
	var b strings.Builder
	for _, e := range list.Items {
		if e.InvolvedObject.Kind == gangv1.Kind {
			fmt.Fprintf(&b, "  %s x%d: %s\n", e.Reason, max(e.Count, 1), e.Message)
		}
	}
	return b.String()
}
