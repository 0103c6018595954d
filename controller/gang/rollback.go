package gang

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"
	"k8s.io/klog/v2"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
)

// This file undoes placements: from the record a placement leaves on its
// gang while it writes claims (whatever the gang's spec says by the time it
// is read), and when a gang is deleted. The only allocation it ever clears
// is a domain channel's (clearClaim): the controller allocates nothing else.

// recordPlacement writes on the gang, before any claim, which claims
// placement id (or, with attempt set, that growth of placement id) is about
// to write: whatever cuts the placement short (a
// crash, a failed write, a conflict), the next reconcile rolls back exactly
// those, even if the gang's selector or spec has changed meanwhile. It
// returns the gang as updated.
func (r *reconciler) recordPlacement(ctx context.Context, g *gangv1.Gang, id, attempt string, ws []claimWrite) (*gangv1.Gang, error) {
	rec := gangv1.UncommittedPlacement{Placement: id, Growth: attempt != "", Attempt: attempt}
	for _, w := range ws {
		rec.Claims = append(rec.Claims, w.claim.Name)
	}
	raw, err := json.Marshal(rec)
	if err != nil {
		return nil, err
	}
	g = g.DeepCopy()
	if g.Annotations == nil {
		g.Annotations = map[string]string{}
	}
	g.Annotations[gangv1.AnnotationUncommitted] = string(raw)
	out, err := r.gangs.Update(ctx, g)
	if err != nil {
		return nil, fmt.Errorf("record placement %s of gang %s/%s before writing its claims: %w", id, g.Namespace, g.Name, err)
	}
	return out, nil
}

// recordOf decodes the gang's uncommitted placement; ok is false without
// one. A record that does not decode names no claims: it is dropped.
func recordOf(g *gangv1.Gang) (rec gangv1.UncommittedPlacement, ok bool) {
	raw, ok := g.Annotations[gangv1.AnnotationUncommitted]
	if !ok {
		return rec, false
	}
	_ = json.Unmarshal([]byte(raw), &rec)
	return rec, true
}

// rollBackRecorded clears the claims the gang's uncommitted placement
// recorded (those still allocated for that placement: a claim written
// again since is left alone) and then drops the record. It returns how many
// claims it freed; ok is false when the gang has no record. A record of
// the committed placement that is not a growth (the commit removes it, so
// only a hand edit leaves one) is dropped without clearing anything.
//
// The record is a list of names, not proof: only the chart's
// tessera-gang-annotations policy keeps others from writing it. So a claim
// is cleared only if it is this gang's (annotation gangv1.AnnotationGang,
// which that policy keeps to the controller on claims), written by the
// record's placement, and (clearClaim) used by no released member. A gang
// created again under a deleted one's name passes the first two for the
// claims the deleted gang left to its running members; the third keeps
// them.
func (r *reconciler) rollBackRecorded(ctx context.Context, g *gangv1.Gang) (freed int, ok bool, _ error) {
	rec, ok := recordOf(g)
	if !ok {
		return 0, false, nil
	}
	if rec.Placement != "" && (rec.Growth || rec.Placement != g.Annotations[gangv1.AnnotationCommitted]) {
		for _, name := range rec.Claims {
			c, err := r.client.ResourceV1().ResourceClaims(g.Namespace).Get(ctx, name, metav1.GetOptions{})
			if apierrors.IsNotFound(err) {
				continue
			}
			if err != nil {
				return freed, true, fmt.Errorf("roll back placement %s of gang %s/%s: read claim %s: %w", rec.Placement, g.Namespace, g.Name, name, err)
			}
			if c.Status.Allocation == nil || c.Annotations[gangv1.AnnotationPlacement] != rec.Placement {
				continue
			}
			if c.Annotations[gangv1.AnnotationGang] != g.Namespace+"/"+g.Name {
				// Another gang's claim, though it carries the
				// record's placement ID (which anyone can read off
				// it): a record names claims, it does not make them
				// this gang's.
				continue
			}
			if rec.Growth {
				// A growth shares its placement's ID: only the claims
				// this attempt wrote, of pods not released yet, are its
				// own (a record naming a running member's claim is
				// stale or forged).
				if rec.Attempt == "" || c.Annotations[gangv1.AnnotationGrowth] != rec.Attempt {
					continue
				}
				if released, err := r.ownerReleased(ctx, c); err != nil {
					return freed, true, fmt.Errorf("roll back a growth of gang %s/%s: %w", g.Namespace, g.Name, err)
				} else if released {
					continue
				}
			}
			cleared, err := clearClaim(ctx, r.client, g.Namespace, name, rec.Placement)
			if err != nil {
				return freed, true, fmt.Errorf("roll back placement %s of gang %s/%s: %w", rec.Placement, g.Namespace, g.Name, err)
			}
			if cleared {
				freed++
			}
		}
	}
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		fresh, err := r.gangs.Get(ctx, g.Namespace, g.Name)
		if err != nil {
			return err
		}
		if cur, ok := recordOf(fresh); !ok || cur.Placement != rec.Placement {
			return nil
		}
		delete(fresh.Annotations, gangv1.AnnotationUncommitted)
		_, err = r.gangs.Update(ctx, fresh)
		return err
	})
	if err != nil && !apierrors.IsNotFound(err) {
		return freed, true, fmt.Errorf("drop the rolled-back placement %s of gang %s/%s: %w", rec.Placement, g.Namespace, g.Name, err)
	}
	if freed > 0 {
		klog.FromContext(ctx).Info("Rolled back an uncommitted placement from its record", "placement", rec.Placement, "claims", freed)
	}
	return freed, true, nil
}

// rollBack frees what an unfinished placement (one a crash interrupted, or
// a lost one) left: the domain claim's channel, once no pod it was reserved
// for exists. Members' own claims hold nothing the controller wrote (only
// the scheduler allocates them, once a member is released). busy is true
// while the domain claim still serves pods of an earlier placement.
func (r *reconciler) rollBack(ctx context.Context, g *gangv1.Gang, v *view, st *gangv1.GangStatus) (busy bool, _ error) {
	freed := 0
	// Only this gang's channel: spec.domainClaimName is the user's word and
	// may name another gang's domain claim, mid-placement.
	if dc := v.domainClaim; dc != nil && dc.Status.Allocation != nil && dc.Annotations[gangv1.AnnotationGang] == g.Namespace+"/"+g.Name {
		for _, ref := range dc.Status.ReservedFor {
			if p, err := r.pods.Pods(dc.Namespace).Get(ref.Name); err == nil && p.UID == ref.UID && !hasGate(p) {
				waiting(st, g.Generation, gangv1.ReasonPlacementPending, fmt.Sprintf("domain claim %s is still in use by pod %s of an earlier placement; waiting for it to end", dc.Name, ref.Name))
				return true, nil
			}
		}
		cleared, err := clearClaim(ctx, r.client, dc.Namespace, dc.Name, "")
		if err != nil {
			return false, err
		}
		if cleared {
			freed++
		}
	}
	if freed > 0 {
		r.recorder.Eventf(g, v1.EventTypeNormal, gangv1.ReasonRolledBack, "rolled back an unfinished placement: freed %d claims", freed)
		klog.FromContext(ctx).Info("Rolled back an unfinished placement", "claims", freed)
		return true, nil
	}
	return false, nil
}

// finalize rolls back an unreleased placement of a deleted gang and lets it
// go. Bound members keep running; released members still waiting to bind
// have their binding failed and are evicted; gated ones stay gated.
func (r *reconciler) finalize(ctx context.Context, g *gangv1.Gang, v *view) error {
	if err := r.deleteReservationRules(ctx, g); err != nil {
		return err
	}
	if _, ok, err := r.rollBackRecorded(ctx, g); err != nil {
		return err
	} else if ok {
		fresh, err := r.gangs.Get(ctx, g.Namespace, g.Name)
		if apierrors.IsNotFound(err) {
			return nil
		}
		if err != nil {
			return err
		}
		g = fresh
	}
	if dc := v.domainClaim; dc != nil && awaits(dc) && dc.Annotations[gangv1.AnnotationGang] == g.Namespace+"/"+g.Name {
		// Members released but not bound wait in the scheduler for a
		// barrier no one would open or fail once the gang is gone, pinned
		// to their nodes (whose devices other placements then leave
		// alone): fail their binding and evict them, as a lost placement
		// does. Bound members run on.
		if err := failBinding(ctx, r.client, g, dc.Annotations[gangv1.AnnotationPlacement], dc, fmt.Sprintf("gang %s/%s was deleted before its members bound", g.Namespace, g.Name)); err != nil {
			return err
		}
		for _, m := range v.live {
			if !m.gated() && m.pod.Spec.NodeName == "" {
				if err := evict(ctx, r.client, m.pod); err != nil {
					return err
				}
			}
		}
	}
	if dc := v.domainClaim; dc != nil && dc.Status.Allocation != nil && dc.Annotations[gangv1.AnnotationGang] == g.Namespace+"/"+g.Name {
		inUse := false
		for _, ref := range dc.Status.ReservedFor {
			if p, err := r.pods.Pods(dc.Namespace).Get(ref.Name); err == nil && p.UID == ref.UID && !hasGate(p) {
				inUse = true
			}
		}
		if !inUse {
			if _, err := clearClaim(ctx, r.client, dc.Namespace, dc.Name, ""); err != nil {
				return err
			}
		}
	}
	if i := slices.Index(g.Finalizers, gangv1.Finalizer); i >= 0 {
		g.Finalizers = slices.Delete(g.Finalizers, i, i+1)
		if _, err := r.gangs.Update(ctx, g); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("remove finalizer of gang %s/%s: %w", g.Namespace, g.Name, err)
		}
	}
	klog.FromContext(ctx).Info("Gang deleted; unreleased placement rolled back")
	return nil
}

// ownerReleased reads the pod that owns claim c from the API server (not a
// cache, which may still show it gated) and says whether it is released
// (its gate gone); a claim without a pod owner, or whose pod is gone, is
// not.
func (r *reconciler) ownerReleased(ctx context.Context, c *resourceapi.ResourceClaim) (bool, error) {
	owner := metav1.GetControllerOf(c)
	if owner == nil || owner.Kind != "Pod" {
		return false, nil
	}
	p, err := r.client.CoreV1().Pods(c.Namespace).Get(ctx, owner.Name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return p.UID == owner.UID && !hasGate(p), nil
}

// inUseBy names a pod claim c is reserved for that exists (the UID
// reserved) and is released (no gate gangv1.SchedulingGate), read from the
// API server: a cache may still show a member gated that the controller
// released a moment ago. It is "" when there is none.
func inUseBy(ctx context.Context, client kubernetes.Interface, c *resourceapi.ResourceClaim) (string, error) {
	for _, ref := range c.Status.ReservedFor {
		if ref.APIGroup != "" || ref.Resource != "pods" {
			continue
		}
		p, err := client.CoreV1().Pods(c.Namespace).Get(ctx, ref.Name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			continue
		}
		if err != nil {
			return "", fmt.Errorf("claim %s/%s: read pod %s it is reserved for: %w", c.Namespace, c.Name, ref.Name, err)
		}
		if p.UID == ref.UID && !hasGate(p) {
			return p.Name, nil
		}
	}
	return "", nil
}
