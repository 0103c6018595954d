package gang

import (
	"context"
	"fmt"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/labels"

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
func (r *reconciler) stuck(in []*member, now time.Time) (lost []string, recheck time.Duration) {
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
			} else if recheck == 0 || left < recheck {
				recheck = left
			}
		}
	}
	return lost, recheck
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
func (r *reconciler) refused(ctx context.Context, in []*member, now time.Time) (lost []string, recheck time.Duration, _ error) {
	var late []*member
	for _, m := range in {
		if m.gated() || m.pod.Spec.NodeName == "" || m.pod.Status.Phase != v1.PodPending || len(m.claims) == 0 {
			continue
		}
		if left := r.unschedulableGrace - now.Sub(boundSince(m.pod)); left > 0 {
			recheck = sooner(recheck, left)
			continue
		}
		late = append(late, m)
	}
	if len(late) == 0 {
		return nil, recheck, nil
	}
	// Rare and worth a fresh read: what the API server holds now.
	snap, err := simulate.List(ctx, r.client)
	if err != nil {
		return nil, 0, err
	}
	nodeList, err := r.nodes.List(labels.Everything())
	if err != nil {
		return nil, 0, err
	}
	nodes := map[string]*v1.Node{}
	for _, n := range nodeList {
		nodes[n.Name] = n
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
		why, err := misfit(ctx, snap, nodes, claims)
		if err != nil {
			return nil, 0, err
		}
		if why != "" {
			lost = append(lost, fmt.Sprintf("member %s is bound to %s but has not started in %v: %s; the kubelet plugin refuses to prepare a device another claim holds",
				m.pod.Name, m.pod.Spec.NodeName, now.Sub(boundSince(m.pod)).Round(time.Second), why))
		}
	}
	if len(lost) == 0 {
		recheck = sooner(recheck, r.unschedulableGrace)
	}
	return lost, recheck, nil
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
