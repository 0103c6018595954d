package gang

import (
	"context"
	"fmt"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/driver/domain"
)

// This file starts a placement's members together. The controller allocates
// only the domain claim's channel, with binding conditions
// (domain.ConditionMembersAllocated, domain.ConditionPlacementFailed); the
// scheduler allocates each released member's own claims on its node and then
// waits in PreBind, binding no member, until the channel's condition is True
// (bindTogether). A placement that cannot be completed sets the failure
// condition instead (failBinding), so that the waiting members' binding
// cycles end at once rather than at the scheduler's binding timeout.

// bindTogether sets ConditionMembersAllocated on the domain claim once every
// member of the placement (in) is released and has each of its own claims
// allocated and reserved for it: only the scheduler allocates them, so
// this is the scheduler's word that the whole placement fits as it planned.
// It is a no-op for a claim that awaits no condition (written without
// binding conditions, or already allowed), and for one that is not gang
// g's for placement id (setChannelCondition).
func (r *reconciler) bindTogether(ctx context.Context, g *gangv1.Gang, id string, dc *resourceapi.ResourceClaim, in []*member) error {
	if dc == nil || !awaits(dc) || !allAllocated(in) {
		return nil
	}
	if r.interrupt != nil && r.interrupt(StepBind) {
		return errInterrupted
	}
	msg := fmt.Sprintf("the claims of all %d members are allocated", len(in))
	if err := setChannelCondition(ctx, r.client, g, id, dc, domain.ConditionMembersAllocated, "MembersAllocated", msg); err != nil {
		return err
	}
	klog.FromContext(ctx).V(2).Info("Every member's claims are allocated; the members may bind", "claim", klog.KObj(dc), "members", len(in))
	return nil
}

// allAllocated says whether every member is released and has each of its
// own claims allocated and reserved for it (by the scheduler).
func allAllocated(in []*member) bool {
	for _, m := range in {
		if m.gated() {
			return false
		}
		for _, c := range m.claims {
			if c.Status.Allocation == nil || !reservedForPod(c, m.pod) {
				return false
			}
		}
	}
	return true
}

// failBinding sets ConditionPlacementFailed on a domain claim whose members
// still wait to bind: the scheduler's binding cycles of those members fail
// at their next poll and nothing of the placement starts. Only gang g's
// claim for placement id (setChannelCondition).
func failBinding(ctx context.Context, client kubernetes.Interface, g *gangv1.Gang, id string, dc *resourceapi.ResourceClaim, why string) error {
	if dc == nil || !awaits(dc) {
		return nil
	}
	return setChannelCondition(ctx, client, g, id, dc, domain.ConditionPlacementFailed, "PlacementFailed", why)
}

// awaits says whether the claim's channel was written with the gang's
// binding conditions and neither is True yet.
func awaits(c *resourceapi.ResourceClaim) bool {
	if c.Status.Allocation == nil || !channelsOnly(c.Status.Allocation) {
		return false
	}
	waits := false
	for _, res := range c.Status.Allocation.Devices.Results {
		if len(res.BindingConditions) > 0 {
			waits = true
		}
	}
	if !waits {
		return false
	}
	for _, d := range c.Status.Devices {
		if apimeta.IsStatusConditionTrue(d.Conditions, domain.ConditionMembersAllocated) || apimeta.IsStatusConditionTrue(d.Conditions, domain.ConditionPlacementFailed) {
			return false
		}
	}
	return true
}

// reservedForPod says whether the claim is reserved for the pod.
func reservedForPod(c *resourceapi.ResourceClaim, p *v1.Pod) bool {
	for _, ref := range c.Status.ReservedFor {
		if ref.Resource == "pods" && ref.UID == p.UID {
			return true
		}
	}
	return false
}

// setChannelCondition sets condition cond True on every allocated device's
// status of the claim (as read fresh from the API server), keeping the
// allocation it was decided on: a claim cleared or allocated again
// meanwhile is left alone.
//
// The claim must be gang g's (annotation gangv1.AnnotationGang) and written
// for placement id (gangv1.AnnotationPlacement), as read fresh: a gang's
// spec.domainClaimName is the user's word and may name another gang's
// domain claim, whose members must neither be let bind before they are all
// allocated nor be failed.
func setChannelCondition(ctx context.Context, client kubernetes.Interface, g *gangv1.Gang, id string, dc *resourceapi.ResourceClaim, cond, reason, msg string) error {
	claims := client.ResourceV1().ResourceClaims(dc.Namespace)
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		c, err := claims.Get(ctx, dc.Name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return nil
		}
		if err != nil {
			return err
		}
		if c.UID != dc.UID || c.Annotations[gangv1.AnnotationGang] != g.Namespace+"/"+g.Name || id == "" || c.Annotations[gangv1.AnnotationPlacement] != id {
			klog.FromContext(ctx).V(2).Info("Not setting a condition on a domain claim of another gang or placement", "claim", klog.KObj(c), "condition", cond, "placement", id)
			return nil
		}
		if c.Status.Allocation == nil || dc.Status.Allocation == nil ||
			!c.Status.Allocation.AllocationTimestamp.Equal(dc.Status.Allocation.AllocationTimestamp) || !awaits(c) {
			return nil
		}
		for _, res := range c.Status.Allocation.Devices.Results {
			i := deviceStatusIndex(c, res)
			if i < 0 {
				c.Status.Devices = append(c.Status.Devices, resourceapi.AllocatedDeviceStatus{Driver: res.Driver, Pool: res.Pool, Device: res.Device})
				i = len(c.Status.Devices) - 1
			}
			apimeta.SetStatusCondition(&c.Status.Devices[i].Conditions, metav1.Condition{
				Type: cond, Status: metav1.ConditionTrue, Reason: reason, Message: msg, ObservedGeneration: c.Generation,
			})
		}
		_, err = claims.UpdateStatus(ctx, c, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		return fmt.Errorf("set condition %s on domain claim %s/%s: %w", cond, dc.Namespace, dc.Name, err)
	}
	return nil
}

// deviceStatusIndex is the index of an allocated device's status entry in
// the claim; -1 without one.
func deviceStatusIndex(c *resourceapi.ResourceClaim, res resourceapi.DeviceRequestAllocationResult) int {
	for i, d := range c.Status.Devices {
		if d.Driver == res.Driver && d.Pool == res.Pool && d.Device == res.Device && ptr.Deref(d.ShareID, "") == string(ptr.Deref(res.ShareID, "")) {
			return i
		}
	}
	return -1
}
