package simulate

import (
	"context"
	"fmt"

	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// Snapshot is what the allocator needs from a live cluster, read at once:
// every DeviceClass, ResourceSlice and ResourceClaim, and the
// DeviceTaintRules applied to the slices.
type Snapshot struct {
	Classes []*resourceapi.DeviceClass
	// Slices carry the taints of Rules on the devices they select, besides
	// their own (see Taint): the devices as the scheduler's allocator sees
	// them.
	Slices []*resourceapi.ResourceSlice
	// Rules are the DeviceTaintRules applied to Slices, to name them in
	// messages (Untolerated).
	Rules  []*resourceapi.DeviceTaintRule
	Claims []*resourceapi.ResourceClaim
}

// List reads a snapshot from the API server (not from a cache: what it says
// is allocated is what the API server holds now), with every DeviceTaintRule
// applied to the slices as kube-scheduler applies them, except those skipRule
// (if set) accepts: a caller that models some rules itself leaves them out,
// and one judging allocations already made (taints keep the allocator from a
// device, they take nothing from a claim that holds it) leaves out all. An
// API server that serves no DeviceTaintRules in resource.k8s.io/v1 has none.
func List(ctx context.Context, client kubernetes.Interface, skipRule func(*resourceapi.DeviceTaintRule) bool) (*Snapshot, error) {
	classList, err := client.ResourceV1().DeviceClasses().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("list device classes: %w", err)
	}
	sliceList, err := client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("list resource slices: %w", err)
	}
	ruleList, err := client.ResourceV1().DeviceTaintRules().List(ctx, metav1.ListOptions{})
	switch {
	case apierrors.IsNotFound(err):
		ruleList = &resourceapi.DeviceTaintRuleList{}
	case err != nil:
		return nil, fmt.Errorf("list device taint rules (the scheduler applies them to the slices): %w", err)
	}
	claims, err := ListClaims(ctx, client)
	if err != nil {
		return nil, err
	}
	s := &Snapshot{Claims: claims}
	for i := range classList.Items {
		s.Classes = append(s.Classes, &classList.Items[i])
	}
	for i := range sliceList.Items {
		s.Slices = append(s.Slices, &sliceList.Items[i])
	}
	for i := range ruleList.Items {
		if skipRule == nil || !skipRule(&ruleList.Items[i]) {
			s.Rules = append(s.Rules, &ruleList.Items[i])
		}
	}
	if s.Slices, err = Taint(ctx, s.Slices, s.Rules); err != nil {
		return nil, err
	}
	return s, nil
}

// EveryRule is a List skipRule that leaves out every DeviceTaintRule: the
// slices as published.
func EveryRule(*resourceapi.DeviceTaintRule) bool { return true }

// ListClaims reads every ResourceClaim of every namespace from the API server.
func ListClaims(ctx context.Context, client kubernetes.Interface) ([]*resourceapi.ResourceClaim, error) {
	claimList, err := client.ResourceV1().ResourceClaims("").List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("list resource claims: %w", err)
	}
	out := make([]*resourceapi.ResourceClaim, 0, len(claimList.Items))
	for i := range claimList.Items {
		out = append(out, &claimList.Items[i])
	}
	return out, nil
}

// Cluster returns an allocator view of the snapshot's slices (those keep
// accepts; all when keep is nil) with every allocated claim's devices taken,
// except the claims skip accepts.
func (s *Snapshot) Cluster(keep func(*resourceapi.ResourceSlice) bool, skip func(*resourceapi.ResourceClaim) bool) *Cluster {
	slices := s.Slices
	if keep != nil {
		slices = nil
		for _, sl := range s.Slices {
			if keep(sl) {
				slices = append(slices, sl)
			}
		}
	}
	c := New(s.Classes, slices)
	for _, claim := range s.Claims {
		if claim.Status.Allocation != nil && (skip == nil || !skip(claim)) {
			c.Commit(*claim.Status.Allocation)
		}
	}
	return c
}
