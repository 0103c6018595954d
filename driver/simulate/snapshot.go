package simulate

import (
	"context"
	"fmt"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// Snapshot is what the allocator needs from a live cluster, read at once:
// every DeviceClass, ResourceSlice and ResourceClaim.
type Snapshot struct {
	Classes []*resourceapi.DeviceClass
	Slices  []*resourceapi.ResourceSlice
	Claims  []*resourceapi.ResourceClaim
}

// List reads a snapshot from the API server (not from a cache: what it says
// is allocated is what the API server holds now).
func List(ctx context.Context, client kubernetes.Interface) (*Snapshot, error) {
	classList, err := client.ResourceV1().DeviceClasses().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("list device classes: %w", err)
	}
	sliceList, err := client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("list resource slices: %w", err)
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
	return s, nil
}

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
