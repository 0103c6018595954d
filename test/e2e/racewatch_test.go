package e2e

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/controller/gang"
)

// This file holds raceWatch: it follows, event by event, every claim of the
// cluster and the pods of a namespace where a gang races other pods for
// devices, and records what must never be seen, judged with the tests' own
// ledger of the slices.

// raceWatch looks at every state of the claims and pods that the watches
// deliver (its own copies, updated from each event in order, not an
// informer's store, which may have moved on by the time a handler runs): it
// reads the allocations as the scheduler does, a List at one resource
// version and then the watch.
type raceWatch struct {
	job  string // the gang's members are this Job's pods
	size int
	// least: the fewest members that may run while others do not, for
	// longer than the skew (size for a gang of fixed size, its minSize for
	// an elastic one).
	least int
	// skew is how long members may run while others do not: they bind
	// together (the domain claim's binding conditions) and start as their
	// kubelets get to them.
	skew   time.Duration
	client kubernetes.Interface
	gangs  dynamic.NamespaceableResourceInterface

	mu     sync.Mutex
	claims map[types.UID]*resourceapi.ResourceClaim
	pods   map[types.UID]*corev1.Pod
	slices map[string]*resourceapi.ResourceSlice
	ledger *ledger // nil after a slice changed: rebuilt at the next look
	looks  int

	open     map[string]openClash // clashes present at the last look
	seen     []seenClash          // every clash that ended, and how long it lasted
	failures []string             // what must never happen, as first seen
	failed   map[string]bool
	// ran: pods seen running; bound: pods seen bound to a node; ever: the
	// last state of every pod seen; owner: the pod each claim made from a
	// template belongs to ("namespace/name" of the claim).
	ran   map[types.UID]bool
	bound map[types.UID]bool
	ever  map[types.UID]*corev1.Pod
	owner map[string]types.UID
	// splitSince: since when some member runs while another does not (zero
	// when the gang runs whole or not at all).
	splitSince   time.Time
	longestSplit time.Duration
	whole        bool // the last look saw every member running
	waitingLooks int  // gang states checked for holding nothing while waiting
}

type openClash struct {
	clash
	since time.Time
}

type seenClash struct {
	clash
	lasted time.Duration
}

func newRaceWatch(client kubernetes.Interface, dyn dynamic.Interface, job string, size, least int, skew time.Duration) *raceWatch {
	return &raceWatch{
		job: job, size: size, least: least, skew: skew, client: client,
		gangs:  dyn.Resource(gangv1.GroupVersionResource),
		claims: map[types.UID]*resourceapi.ResourceClaim{}, pods: map[types.UID]*corev1.Pod{},
		slices: map[string]*resourceapi.ResourceSlice{}, open: map[string]openClash{},
		failed: map[string]bool{}, ran: map[types.UID]bool{}, bound: map[types.UID]bool{},
		ever: map[types.UID]*corev1.Pod{}, owner: map[string]types.UID{},
	}
}

// start watches every claim and slice, and the namespace's pods and gangs,
// until ctx ends; it returns once the watches have listed.
func (w *raceWatch) start(ctx context.Context, t testing.TB, dyn dynamic.Interface, ns string) {
	t.Helper()
	nsFactory := informers.NewSharedInformerFactoryWithOptions(w.client, 0, informers.WithNamespace(ns))
	all := informers.NewSharedInformerFactory(w.client, 0)
	gangFactory := dynamicinformer.NewFilteredDynamicSharedInformerFactory(dyn, 0, ns, nil)
	handler := func(set func(obj any, gone bool)) cache.ResourceEventHandler {
		return cache.ResourceEventHandlerFuncs{
			AddFunc:    func(o any) { set(o, false) },
			UpdateFunc: func(_, o any) { set(o, false) },
			DeleteFunc: func(o any) {
				if d, ok := o.(cache.DeletedFinalStateUnknown); ok {
					o = d.Obj
				}
				set(o, true)
			},
		}
	}
	var err error
	_, err = all.Resource().V1().ResourceClaims().Informer().AddEventHandler(handler(func(o any, gone bool) {
		c := o.(*resourceapi.ResourceClaim)
		w.update(func() {
			if gone {
				delete(w.claims, c.UID)
				return
			}
			w.claims[c.UID] = c
			for _, ref := range c.OwnerReferences {
				if ref.Kind == "Pod" {
					w.owner[c.Namespace+"/"+c.Name] = ref.UID
				}
			}
		})
	}))
	noErr(t, err)
	_, err = nsFactory.Core().V1().Pods().Informer().AddEventHandler(handler(func(o any, gone bool) {
		p := o.(*corev1.Pod)
		w.update(func() {
			if gone {
				delete(w.pods, p.UID)
				return
			}
			w.pods[p.UID] = p
			w.ever[p.UID] = p
			if p.Spec.NodeName != "" {
				w.bound[p.UID] = true
			}
			if p.Status.Phase == corev1.PodRunning {
				w.ran[p.UID] = true
			}
		})
	}))
	noErr(t, err)
	_, err = all.Resource().V1().ResourceSlices().Informer().AddEventHandler(handler(func(o any, gone bool) {
		s := o.(*resourceapi.ResourceSlice)
		w.update(func() {
			if gone {
				delete(w.slices, s.Name)
			} else {
				w.slices[s.Name] = s
			}
			w.ledger = nil
		})
	}))
	noErr(t, err)
	_, err = gangFactory.ForResource(gangv1.GroupVersionResource).Informer().AddEventHandler(handler(func(o any, gone bool) {
		if !gone {
			w.checkWaiting(ctx, o.(*unstructured.Unstructured))
		}
	}))
	noErr(t, err)
	nsFactory.Start(ctx.Done())
	all.Start(ctx.Done())
	gangFactory.Start(ctx.Done())
	synced(t, nsFactory.WaitForCacheSync(ctx.Done()))
	synced(t, all.WaitForCacheSync(ctx.Done()))
	synced(t, gangFactory.WaitForCacheSync(ctx.Done()))
	// A look also every lookEvery, not only on events: a split that
	// outlasts the skew fails while it lasts, whether or not an event
	// arrives.
	go func() {
		tick := time.NewTicker(lookEvery)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
				w.update(func() {})
			}
		}
	}()
}

// lookEvery is how often a raceWatch looks when no event arrives.
const lookEvery = time.Second

// synced fails the test unless every informer synced.
func synced[K comparable](t testing.TB, m map[K]bool) {
	t.Helper()
	for what, ok := range m {
		if !ok {
			t.Fatalf("watch of %v did not sync", what)
		}
	}
}

// update applies one event to the watch's copies, then looks.
func (w *raceWatch) update(apply func()) {
	w.mu.Lock()
	defer w.mu.Unlock()
	apply()
	w.look(time.Now())
}

// fail records a failure the first time it is seen.
func (w *raceWatch) fail(key, msg string) {
	if !w.failed[key] {
		w.failed[key] = true
		w.failures = append(w.failures, msg)
	}
}

// look judges the current state: overlaps between allocated claims (never,
// not for an instant), and members running while others are not (for less
// than the start skew).
func (w *raceWatch) look(now time.Time) {
	w.looks++
	if w.ledger == nil {
		var list []*resourceapi.ResourceSlice
		for _, s := range w.slices {
			list = append(list, s)
		}
		w.ledger = newLedger(list)
	}
	var allocated, inUse []*resourceapi.ResourceClaim
	for _, c := range w.claims {
		if c.Status.Allocation == nil {
			continue
		}
		allocated = append(allocated, c)
		for _, p := range w.ownersOf(c) {
			if p.Status.Phase == corev1.PodRunning && p.DeletionTimestamp == nil {
				inUse = append(inUse, c)
				break
			}
		}
	}
	current := map[string]bool{}
	for _, c := range w.ledger.clashes(allocated) {
		current[c.key()] = true
		if members := w.membersOf(c.claims); len(members) > 0 {
			w.fail("clash "+c.key(), fmt.Sprintf("%s (gang members' claims among them: %v): a device allocated to two claims at once", c, members))
		} else {
			w.fail("clash "+c.key(), fmt.Sprintf("%s: a device allocated to two claims at once", c))
		}
		if _, ok := w.open[c.key()]; !ok {
			w.open[c.key()] = openClash{clash: c, since: now}
		}
	}
	for key, o := range w.open {
		if !current[key] {
			w.seen = append(w.seen, seenClash{clash: o.clash, lasted: now.Sub(o.since)})
			delete(w.open, key)
		}
	}
	for _, c := range w.ledger.clashes(inUse) {
		w.fail("used "+c.key(), fmt.Sprintf("%s, whose pods both run", c))
	}

	var live, running []string
	for _, p := range w.pods {
		if p.Labels[jobName] != w.job || finished(p) {
			continue
		}
		live = append(live, p.Name)
		if p.Status.Phase == corev1.PodRunning && w.claimsAllocated(p) {
			running = append(running, p.Name)
		}
	}
	w.whole = len(running) == w.size && len(live) == w.size
	split := len(running) > 0 && len(running) < w.least
	switch {
	case split && w.splitSince.IsZero():
		w.splitSince = now
	case split && now.Sub(w.splitSince) > w.skew:
		sort.Strings(live)
		sort.Strings(running)
		w.fail("split", fmt.Sprintf("members %v run while fewer than %d of %v do, for %v: longer than the start skew %v", running, w.least, live, now.Sub(w.splitSince).Round(time.Second), w.skew))
	case !split && !w.splitSince.IsZero():
		// A split that ends is judged on its whole length: one longer than
		// the skew fails even when no look fell past the skew while it
		// lasted.
		lasted := now.Sub(w.splitSince)
		if lasted > w.skew {
			w.fail("split", fmt.Sprintf("members ran while fewer than %d of the gang did, for %v: longer than the start skew %v", w.least, lasted.Round(time.Second), w.skew))
		}
		w.longestSplit = max(w.longestSplit, lasted)
		w.splitSince = time.Time{}
	}
}

// finished: a pod that ended or is on its way out.
func finished(p *corev1.Pod) bool {
	return p.DeletionTimestamp != nil || p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed
}

// ownersOf are the pods a claim belongs to: its owner (a claim made from a
// template) or those it is reserved for (a shared claim).
func (w *raceWatch) ownersOf(c *resourceapi.ResourceClaim) []*corev1.Pod {
	var out []*corev1.Pod
	for _, ref := range c.OwnerReferences {
		if p, ok := w.pods[ref.UID]; ok && ref.Kind == "Pod" {
			out = append(out, p)
		}
	}
	if len(out) > 0 {
		return out
	}
	for _, ref := range c.Status.ReservedFor {
		if p, ok := w.pods[ref.UID]; ok && ref.Resource == "pods" {
			out = append(out, p)
		}
	}
	return out
}

// membersOf names the gang members' claims among the claims: those the
// controller annotated with its gang.
func (w *raceWatch) membersOf(claims []string) []string {
	var out []string
	for _, c := range w.claims {
		if c.Annotations[gangv1.AnnotationGang] != "" && slices.Contains(claims, c.Namespace+"/"+c.Name) {
			out = append(out, c.Name)
		}
	}
	sort.Strings(out)
	return out
}

// claimsAllocated says whether every claim the pod owns is allocated.
func (w *raceWatch) claimsAllocated(p *corev1.Pod) bool {
	for _, c := range w.claims {
		if metav1.IsControlledBy(c, p) && c.Status.Allocation == nil {
			return false
		}
	}
	return true
}

// checkWaiting: a gang that says it waits, with no placement being written
// or committed, holds nothing: no gated member's claim is allocated, nor the
// domain claim while every member is gated. What it reads is fresh from the
// API server and counts only if the gang has not changed meanwhile (a
// placement records itself on the gang before it writes a claim).
func (w *raceWatch) checkWaiting(ctx context.Context, u *unstructured.Unstructured) {
	g, err := gang.FromUnstructured(u)
	// Only the watched gang: its members are the Job's pods listed below
	// (another gang of the namespace, as a preemption's victim, has others).
	if err != nil || g.Name != w.job || !meta.IsStatusConditionTrue(g.Status.Conditions, gangv1.ConditionWaiting) {
		return
	}
	if _, ok := g.Annotations[gangv1.AnnotationCommitted]; ok {
		return
	}
	if _, ok := g.Annotations[gangv1.AnnotationUncommitted]; ok {
		return
	}
	pods, err := w.client.CoreV1().Pods(g.Namespace).List(ctx, metav1.ListOptions{LabelSelector: jobName + "=" + w.job})
	if err != nil {
		return
	}
	claims, err := w.client.ResourceV1().ResourceClaims(g.Namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		return
	}
	fresh, err := w.gangs.Namespace(g.Namespace).Get(ctx, g.Name, metav1.GetOptions{})
	if err != nil || fresh.GetResourceVersion() != g.ResourceVersion {
		return
	}
	gated := map[types.UID]string{}
	allGated := true
	for _, p := range pods.Items {
		if slices.ContainsFunc(p.Spec.SchedulingGates, func(s corev1.PodSchedulingGate) bool { return s.Name == gangv1.SchedulingGate }) {
			gated[p.UID] = p.Name
		} else {
			allGated = false
		}
	}
	var held []string
	for _, c := range claims.Items {
		if c.Status.Allocation == nil {
			continue
		}
		for _, ref := range c.OwnerReferences {
			if name, ok := gated[ref.UID]; ok {
				held = append(held, fmt.Sprintf("claim %s of gated member %s", c.Name, name))
			}
		}
		if c.Name == g.Spec.DomainClaimName && allGated {
			held = append(held, "the domain claim "+c.Name+" while every member is gated")
		}
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.waitingLooks++
	if len(held) > 0 {
		w.fail("held "+strings.Join(held, ","), fmt.Sprintf("gang waits (%s) without a placement in progress, yet holds %s", conditionReasonOf(g), strings.Join(held, "; ")))
	}
}

func conditionReasonOf(g *gangv1.Gang) string {
	if c := meta.FindStatusCondition(g.Status.Conditions, gangv1.ConditionWaiting); c != nil {
		return c.Reason + ": " + c.Message
	}
	return ""
}

// raceReport is what a raceWatch saw, once the race is over.
type raceReport struct {
	failures []string
	// clashes: every overlap seen, with how long it lasted.
	clashes      []seenClash
	looks        int
	waitingLooks int
	longestSplit time.Duration
	// pods: every pod seen, its last state; ran and bound: which ran, which
	// were bound to a node.
	pods  map[types.UID]*corev1.Pod
	ran   map[types.UID]bool
	bound map[types.UID]bool
	// owner: the pod each claim belongs to.
	owner map[string]types.UID
}

// report closes the watch's accounts as of now.
func (w *raceWatch) report() raceReport {
	w.mu.Lock()
	defer w.mu.Unlock()
	now := time.Now()
	// A split still open at the close counts as closing now.
	if !w.splitSince.IsZero() && now.Sub(w.splitSince) > w.skew {
		w.fail("split", fmt.Sprintf("members ran while fewer than %d of the gang did, for %v and still at the close: longer than the start skew %v", w.least, now.Sub(w.splitSince).Round(time.Second), w.skew))
	}
	r := raceReport{
		failures: slices.Clone(w.failures), clashes: slices.Clone(w.seen), looks: w.looks, waitingLooks: w.waitingLooks,
		longestSplit: w.longestSplit, pods: map[types.UID]*corev1.Pod{}, ran: map[types.UID]bool{}, bound: map[types.UID]bool{}, owner: map[string]types.UID{},
	}
	for _, o := range w.open {
		r.clashes = append(r.clashes, seenClash{clash: o.clash, lasted: now.Sub(o.since)})
	}
	if !w.splitSince.IsZero() {
		r.longestSplit = max(r.longestSplit, now.Sub(w.splitSince))
	}
	for uid, p := range w.ever {
		r.pods[uid], r.ran[uid], r.bound[uid] = p, w.ran[uid], w.bound[uid]
	}
	for k, v := range w.owner {
		r.owner[k] = v
	}
	return r
}

// isWhole says whether the last look saw every member running.
func (w *raceWatch) isWhole() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.whole
}

// pod is the last state seen of the namespace's pod of that name; nil when
// none exists.
func (w *raceWatch) pod(name string) *corev1.Pod {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, p := range w.pods {
		if p.Name == name {
			return p
		}
	}
	return nil
}

// count counts the pods seen that match.
func (w *raceWatch) count(match func(p *corev1.Pod, ran bool) bool) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	n := 0
	for uid, p := range w.ever {
		if match(p, w.ran[uid]) {
			n++
		}
	}
	return n
}
