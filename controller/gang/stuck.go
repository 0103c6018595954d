package gang

import (
	"context"
	"fmt"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/driver/simulate"
)

// This file finds released members that will never run where they were
// placed; the gang is then handled as one that lost a member (evicted and
// placed again).

// stuck names the released members the scheduler has found unschedulable
// (on the node they are pinned to: another pod took its room after the
// placement) for longer than the grace period; such a gang holds its devices
// without running, so it is handled as one that lost a member. recheck is
// when a member unschedulable for less than that is to be looked at again.
func (r *reconciler) stuck(in []*member, now time.Time) (lost []string, who []*member, recheck time.Duration) {
	for _, m := range in {
		if m.gated() || m.pod.Spec.NodeName != "" {
			continue
		}
		for _, c := range m.pod.Status.Conditions {
			if c.Type != v1.PodScheduled || c.Status != v1.ConditionFalse || c.Reason != v1.PodReasonUnschedulable {
				continue
			}
			left := r.unschedulableGrace - now.Sub(c.LastTransitionTime.Time)
			if left <= 0 {
				lost = append(lost, fmt.Sprintf("member %s cannot be scheduled on the node it was placed on: %s", m.pod.Name, c.Message))
				who = append(who, m)
			} else if recheck == 0 || left < recheck {
				recheck = left
			}
		}
	}
	return lost, who, recheck
}

// refused names the members bound to a node that have not started for
// longer than the grace period while a device of their claims is allocated
// to another claim too. The scheduler can allocate a device in the very
// moment the controller writes it to a member's claim, after the re-check
// (docs/gang.md); the kubelet plugin then refuses the second prepare, and
// the gang would hold every device with a member short, forever. Placed
// again, the gang goes where no other claim holds its devices. recheck is
// when members bound more recently, or not started without a double
// allocation, are to be looked at again.
//
// retry names the members bound for prepareRetryAfter (or the grace,
// when shorter) without a sandbox whose claims fit: most often a prepare
// refused while another claim held the device, which has gone since. The
// kubelet does not count a refused prepare as a failed sync and tries again
// only at its next resync (its sync frequency, 1m by default, plus up to
// half that); the caller asks it sooner (nudge), at most once per
// prepareRetryAfter per member.
func (r *reconciler) refused(ctx context.Context, in []*member, now time.Time) (lost []string, who, retry []*member, recheck time.Duration, _ error) {
	retryAfter := min(prepareRetryAfter, r.unschedulableGrace)
	var late []*member
	for _, m := range in {
		if m.gated() || m.pod.Spec.NodeName == "" || m.pod.Status.Phase != v1.PodPending || len(m.claims) == 0 {
			continue
		}
		bound := now.Sub(boundSince(m.pod))
		lostIn := r.unschedulableGrace - bound
		if !sandboxReady(m.pod) {
			if left := retryAfter - bound; left > 0 {
				recheck = sooner(recheck, left)
				continue
			}
		} else if lostIn > 0 {
			recheck = sooner(recheck, lostIn)
			continue
		}
		late = append(late, m)
	}
	if len(late) == 0 {
		return nil, nil, nil, recheck, nil
	}
	// Rare and worth a fresh read: what the API server holds now. Claims
	// allocated already are judged against the slices as published: a
	// DeviceTaintRule added since keeps new claims off a device, and
	// neither makes the kubelet plugin refuse one that holds it nor evicts
	// (the upstream device-taint eviction controller evicts for NoExecute).
	snap, nodes, _, err := r.cluster(ctx, simulate.EveryRule)
	if err != nil {
		return nil, nil, nil, 0, err
	}
	current := map[string]*resourceapi.ResourceClaim{}
	for _, c := range snap.Claims {
		current[string(c.UID)] = c
	}
	for _, m := range late {
		var claims []*resourceapi.ResourceClaim
		for _, c := range m.claims {
			if cur, ok := current[string(c.UID)]; ok {
				claims = append(claims, cur)
			}
		}
		why, err := heldMisfit(ctx, snap, nodes, claims)
		if err != nil {
			return nil, nil, nil, 0, err
		}
		bound := now.Sub(boundSince(m.pod))
		switch {
		case why != "" && bound >= r.unschedulableGrace:
			lost = append(lost, fmt.Sprintf("member %s is bound to %s but has not started in %v: %s; the kubelet plugin refuses to prepare a device another claim holds",
				m.pod.Name, m.pod.Spec.NodeName, bound.Round(time.Second), why))
			who = append(who, m)
		case why != "":
			// Refused, and the other claim still holds the device: lost
			// at the end of the grace unless it goes.
			recheck = sooner(recheck, min(retryAfter, r.unschedulableGrace-bound))
		case sandboxReady(m.pod):
			recheck = sooner(recheck, r.unschedulableGrace)
		default:
			if since := now.Sub(retriedAt(m.pod, now)); since >= retryAfter {
				retry = append(retry, m)
			} else {
				recheck = sooner(recheck, retryAfter-since)
				continue
			}
			recheck = sooner(recheck, retryAfter)
		}
	}
	if len(lost) != 0 {
		return lost, who, nil, recheck, nil
	}
	return nil, nil, retry, recheck, nil
}

// prepareRetryAfter is how long a bound member without a sandbox waits
// before the controller asks its kubelet to prepare it again, and between
// two asks: the kubelet's own back-off after a failed sync.
const prepareRetryAfter = 10 * time.Second

// sandboxReady says whether the kubelet has made the pod's sandbox, which
// it does only once the pod's claims are prepared.
func sandboxReady(p *v1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == v1.PodReadyToStartContainers {
			return c.Status == v1.ConditionTrue
		}
	}
	return false
}

// retriedAt is when the controller last asked the pod's kubelet to prepare
// it again (gangv1.AnnotationPrepareRetry); the zero time if never, if the
// value is not a time, or if it lies after now (a clock ahead, or a hand
// edit, would otherwise silence the asks until then).
func retriedAt(p *v1.Pod, now time.Time) time.Time {
	at, err := time.Parse(time.RFC3339, p.Annotations[gangv1.AnnotationPrepareRetry])
	if err != nil || at.After(now) {
		return time.Time{}
	}
	return at
}

// nudge sets gangv1.AnnotationPrepareRetry on a released member to now: a
// change of the pod's annotations makes its kubelet sync the pod at once,
// preparing its claims again. Nothing else of the pod changes. An update,
// as release does: the controller's role grants no patch. A pod gone, or
// asked again meanwhile (by a controller reading a fresher cache), is left
// alone.
func nudge(ctx context.Context, client kubernetes.Interface, m *member, now time.Time, every time.Duration) error {
	pods := client.CoreV1().Pods(m.pod.Namespace)
	p := m.pod.DeepCopy()
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		if p.Annotations == nil {
			p.Annotations = map[string]string{}
		}
		p.Annotations[gangv1.AnnotationPrepareRetry] = now.UTC().Format(time.RFC3339)
		_, err := pods.Update(ctx, p, metav1.UpdateOptions{})
		if !apierrors.IsConflict(err) {
			return err
		}
		fresh, gerr := pods.Get(ctx, p.Name, metav1.GetOptions{})
		switch {
		case gerr != nil:
			return gerr
		case fresh.UID != m.pod.UID || fresh.Spec.NodeName == "" || now.Sub(retriedAt(fresh, now)) < every:
			return nil
		}
		p = fresh
		return err
	})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("ask the kubelet to prepare member %s/%s again: %w", m.pod.Namespace, m.pod.Name, err)
	}
	return nil
}

// boundSince is when the scheduler bound the pod (its PodScheduled
// condition turned true), or its creation when that is not recorded.
func boundSince(p *v1.Pod) time.Time {
	for _, c := range p.Status.Conditions {
		if c.Type == v1.PodScheduled && c.Status == v1.ConditionTrue && !c.LastTransitionTime.IsZero() {
			return c.LastTransitionTime.Time
		}
	}
	return p.CreationTimestamp.Time
}

// sooner is the earlier of two delays, zero meaning none.
func sooner(a, b time.Duration) time.Duration {
	if a == 0 || (b > 0 && b < a) {
		return b
	}
	return a
}
