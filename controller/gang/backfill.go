package gang

import (
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/resourceclaim"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/driver/simulate"
)

// Whose word a reservation takes, and which pods it may evict. A pod's end
// as it declares it (activeDeadlineSeconds, which the kubelet enforces, or
// the expected-runtime annotation, which nothing enforces) decides where
// and from when a gang can start. But only an end that comes evicts anyone
// else: backfill is evicted ahead of a start that rests on enforced ends
// only (enforced), and otherwise once the pods waited for have really
// ended. A backfill pod is one whose claims tolerate the reservation by
// its key (backfill), or one that came onto a reserved node after the rule
// there with claims that tolerate the rule's taint in any way (cameUnder):
// a toleration of every taint does not make a pod backfill where it ran
// before, but it cannot be used to take a reservation's devices for good.

// expectedEnd is when the pod is expected to end: its start plus the
// earlier of its activeDeadlineSeconds and its declared expected runtime
// (a pod not started yet starts now at the earliest); false when it
// declares neither.
func expectedEnd(p *v1.Pod, now time.Time) (time.Time, bool) {
	start := now
	if p.Status.StartTime != nil {
		start = p.Status.StartTime.Time
	}
	var end time.Time
	ok := false
	if s := p.Spec.ActiveDeadlineSeconds; s != nil && *s > 0 {
		end, ok = start.Add(time.Duration(*s)*time.Second), true
	}
	if d, err := time.ParseDuration(p.Annotations[gangv1.AnnotationExpectedRuntime]); err == nil && d > 0 {
		if e := start.Add(d); !ok || e.Before(end) {
			end, ok = e, true
		}
	}
	return end, ok
}

// overrunGrace is how long past its declared end a pod is still expected
// to end: a kubelet enforcing activeDeadlineSeconds takes seconds; a pod
// whose expected runtime was a lie stops holding a reservation after this.
const overrunGrace = time.Minute

// arrivedAt is when the pod came onto the devices it holds: when its claims
// were allocated (the latest allocationTimestamp of its claims of the
// driver, where the scheduler records one for each), else when it was
// bound (its PodScheduled condition's last transition to True), else when
// it started, else when it was created. A reservation's taint keeps the
// allocator from devices, so the moment that decides whether a pod came
// under it is its allocation: a pod bound before the rule whose kubelet
// reported its start only after it ran there before the reservation, and a
// pod created before the rule but scheduled after it came under it.
func (pr *preemptor) arrivedAt(p *v1.Pod) time.Time {
	var allocated time.Time
	claims := pr.podClaims[p.UID]
	for _, c := range claims {
		at := c.Status.Allocation.AllocationTimestamp
		if at == nil || at.IsZero() {
			allocated = time.Time{}
			break
		}
		if at.After(allocated) {
			allocated = at.Time
		}
	}
	if len(claims) > 0 && !allocated.IsZero() {
		return allocated
	}
	for _, c := range p.Status.Conditions {
		if c.Type == v1.PodScheduled && c.Status == v1.ConditionTrue && !c.LastTransitionTime.IsZero() {
			return c.LastTransitionTime.Time
		}
	}
	if p.Status.StartTime != nil {
		return p.Status.StartTime.Time
	}
	return p.CreationTimestamp.Time
}

// tolerates says whether a device toleration tolerates gang's reservation
// taint (effect NoSchedule): its key exactly, with operator Exists (any
// reservation) or Equal to the gang's UID. A toleration of every taint
// (no key) does not make a backfill pod: it is how pods tolerate health
// taints.
func tolerates(t resourceapi.DeviceToleration, gang types.UID) bool {
	if t.Key != gangv1.TaintReserved || (t.Effect != "" && t.Effect != resourceapi.DeviceTaintEffectNoSchedule) {
		return false
	}
	switch t.Operator {
	case resourceapi.DeviceTolerationOpExists:
		return true
	case resourceapi.DeviceTolerationOpEqual, "":
		return t.Value == string(gang)
	}
	return false
}

// backfill says whether the pod is a backfill pod for the gang: one of
// its claims tolerates the gang's reservation.
func (pr *preemptor) backfill(p *v1.Pod, gang types.UID) bool {
	for _, c := range pr.podClaims[p.UID] {
		for _, tols := range requestTolerations(c) {
			if slices.ContainsFunc(tols, func(t resourceapi.DeviceToleration) bool { return tolerates(t, gang) }) {
				return true
			}
		}
	}
	return false
}

// cameUnder says whether the pod came onto its node (arrivedAt) after the
// gang's rule there (tainted, and not before since) with claims that
// tolerate the reservation's taint, under either key, in any way the
// scheduler accepts (a toleration of every taint included), and is no
// member of a placed gang (placements): it can have got there only by
// tolerating the reservation. Pods that ran there before keep their
// devices, whatever they tolerate.
func (pr *preemptor) cameUnder(p *v1.Pod, gang types.UID, since time.Time, tainted map[string]time.Time, placements map[string]bool) bool {
	from, ok := tainted[p.Spec.NodeName]
	if !ok {
		return false
	}
	if from.Before(since) {
		from = since
	}
	if !pr.arrivedAt(p).After(from) || placements[p.Namespace+"/"+p.Annotations[gangv1.AnnotationPlacement]] {
		return false
	}
	taints := []resourceapi.DeviceTaint{
		{Key: gangv1.TaintReserved, Value: string(gang), Effect: resourceapi.DeviceTaintEffectNoSchedule},
		{Key: gangv1.TaintReservationStarted, Value: string(gang), Effect: resourceapi.DeviceTaintEffectNoSchedule},
	}
	for _, c := range pr.podClaims[p.UID] {
		for _, tols := range requestTolerations(c) {
			for _, t := range tols {
				for _, taint := range taints {
					if resourceclaim.ToleratesTaint(t, taint) {
						return true
					}
				}
			}
		}
	}
	return false
}

// requestTolerations are the tolerations of each request (and subrequest)
// of the claim.
func requestTolerations(c *resourceapi.ResourceClaim) [][]resourceapi.DeviceToleration {
	var out [][]resourceapi.DeviceToleration
	for _, r := range c.Spec.Devices.Requests {
		if r.Exactly != nil {
			out = append(out, r.Exactly.Tolerations)
		}
		for _, s := range r.FirstAvailable {
			out = append(out, s.Tolerations)
		}
	}
	return out
}

// enforced says whether the pod's expected end (expectedEnd) is one the
// kubelet enforces: its activeDeadlineSeconds, no later than any runtime
// it declares, counted from a start the kubelet reported. An end that rests
// on the expected-runtime annotation alone is its owner's word; one of a
// pod that never started (a lost node, a kubelet that never admitted it)
// moves with every look.
func enforced(p *v1.Pod) bool {
	s := p.Spec.ActiveDeadlineSeconds
	if s == nil || *s <= 0 || p.Status.StartTime == nil {
		return false
	}
	d, err := time.ParseDuration(p.Annotations[gangv1.AnnotationExpectedRuntime])
	return err != nil || d <= 0 || time.Duration(*s)*time.Second <= d
}

// taintedSince maps each node to when gang g's reservation first tainted
// its pool (taintedAt: carried across the switch to the started key; the
// informer's cache; the earliest of its rules there).
func (r *reconciler) taintedSince(g *gangv1.Gang, snap *simulate.Snapshot) (map[string]time.Time, error) {
	out := map[string]time.Time{}
	if r.taintRules == nil {
		return out, nil
	}
	rules, err := r.taintRules.List(labels.SelectorFromSet(labels.Set{gangv1.LabelReservation: string(g.UID)}))
	if err != nil {
		return nil, fmt.Errorf("list the reservation rules of gang %s/%s: %w", g.Namespace, g.Name, err)
	}
	created := map[string]time.Time{}
	for _, rule := range rules {
		if !reservationRule(rule) || rule.Spec.DeviceSelector == nil || rule.Spec.DeviceSelector.Pool == nil {
			continue
		}
		pool, at := *rule.Spec.DeviceSelector.Pool, taintedAt(rule)
		if t, ok := created[pool]; !ok || at.Before(t) {
			created[pool] = at
		}
	}
	for _, sl := range snap.Slices {
		if sl.Spec.Driver != r.driver || sl.Spec.NodeName == nil {
			continue
		}
		if at, ok := created[sl.Spec.Pool.Name]; ok {
			out[*sl.Spec.NodeName] = at
		}
	}
	return out, nil
}

// backfillRefusalGrace is how long a reservation waits for a backfill pod
// whose eviction a PodDisruptionBudget refuses before counting it as
// staying. A budget refuses while the pods it covers are disrupted or not
// ready: one allowing a disruption at a time lets the next pod go once the
// last one's replacement is ready, which takes seconds to a few minutes
// (an image pull, a readiness probe); the reservation tries again every
// few seconds meanwhile. A budget that still refuses after five minutes is
// not a rollout under way but one that never allows (minAvailable equal
// to the pods, or any tenant's pod tolerating the reservation under its
// own budget): without the grace, such a pod would keep the reservation
// started, its pools tainted against everyone but the gang and the
// devices freed there idle, for ever.
const backfillRefusalGrace = 5 * time.Minute

// keepRefusals keeps, of the gang's records of refused backfill evictions
// in st, those of pods that still run.
func keepRefusals(st *gangv1.GangStatus, pods []*v1.Pod) {
	running := map[string]bool{}
	for _, p := range pods {
		if !finished(p) {
			running[p.Namespace+"/"+p.Name] = true
		}
	}
	st.BackfillRefusals = slices.DeleteFunc(st.BackfillRefusals, func(r gangv1.BackfillRefusal) bool { return !running[r.Pod] })
	if len(st.BackfillRefusals) == 0 {
		st.BackfillRefusals = nil
	}
}

// addRefusals records in st the pods (namespace/name) whose eviction was
// refused now and not before; at most gangv1.MaxBackfillRefusals are
// kept, the first refused first.
func addRefusals(st *gangv1.GangStatus, refused []string, now time.Time) {
	for _, pod := range refused {
		if len(st.BackfillRefusals) >= gangv1.MaxBackfillRefusals {
			return
		}
		if !slices.ContainsFunc(st.BackfillRefusals, func(r gangv1.BackfillRefusal) bool { return r.Pod == pod }) {
			st.BackfillRefusals = append(st.BackfillRefusals, gangv1.BackfillRefusal{Pod: pod, Since: metav1.NewTime(now.Truncate(time.Second))})
		}
	}
}

// stayingPods are the pods (namespace/name) of st's refusals refused for
// longer than backfillRefusalGrace: the gang's reservations count them as
// staying, neither backfill to evict nor expected to free their devices
// (but for an end they declare, as any pod's), sorted.
func stayingPods(st *gangv1.GangStatus, now time.Time) []string {
	var out []string
	for _, r := range st.BackfillRefusals {
		if now.Sub(r.Since.Time) > backfillRefusalGrace {
			out = append(out, r.Pod)
		}
	}
	sort.Strings(out)
	return out
}

// stayingNote says, for the gang's Waiting message, which backfill pods
// the gang's reservations count as staying ("" when none), starting with
// "; ".
func stayingNote(st *gangv1.GangStatus, now time.Time) string {
	staying := stayingPods(st, now)
	if len(staying) == 0 {
		return ""
	}
	return fmt.Sprintf("; counted as staying, their eviction refused by a PodDisruptionBudget for over %v: %s", backfillRefusalGrace, strings.Join(capped(staying), ", "))
}
