package plugin

import (
	"context"
	"fmt"
	"strconv"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	"github.com/tessera-dev/tessera/driver/slices"
)

// prepublish creates a node's ResourceSlices itself when the node has none
// of Tessera's, named and shaped as kubeletplugin's ResourceSlice controller
// creates them (index-prefixed names, the Node as controlling owner, pool
// generation 1). The controller then finds them current and adopts them.
//
// Why: the controller only writes after its informer synced, which it polls
// once a second, so a fresh node's GPUs would wait at least a second to be
// schedulable. A node that already has slices (a plugin restart, an upgrade)
// is left to the controller, as is any pool but the node's own. It returns
// how many slices it created; on an error the controller publishes as usual.
func prepublish(ctx context.Context, client kubernetes.Interface, nodeName string, res resourceslice.DriverResources) (int, error) {
	pool, ok := res.Pools[nodeName]
	if !ok || len(res.Pools) != 1 || len(pool.Slices) == 0 || pool.NodeSelector != nil || pool.AllNodes {
		return 0, nil
	}
	api := client.ResourceV1().ResourceSlices()
	existing, err := api.List(ctx, metav1.ListOptions{FieldSelector: "spec.driver=" + slices.DriverName + ",spec.nodeName=" + nodeName})
	if err != nil {
		return 0, fmt.Errorf("list the node's slices: %w", err)
	}
	if len(existing.Items) > 0 {
		return 0, nil
	}
	node, err := client.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
	if err != nil {
		return 0, fmt.Errorf("get node %s to own its slices: %w", nodeName, err)
	}
	owner := metav1.OwnerReference{APIVersion: "v1", Kind: "Node", Name: nodeName, UID: node.UID, Controller: ptr.To(true)}
	// The controller matches slices to its desired ones by this prefix: the
	// index in hex, at least five digits.
	width := max(5, len(strconv.FormatInt(int64(len(pool.Slices)-1), 16)))
	for i, s := range pool.Slices {
		slice := &resourceapi.ResourceSlice{
			ObjectMeta: metav1.ObjectMeta{
				GenerateName:    fmt.Sprintf("%0*x-%s-%s-", width, i, slices.DriverName, nodeName),
				OwnerReferences: []metav1.OwnerReference{owner},
			},
			Spec: resourceapi.ResourceSliceSpec{
				Driver:                 slices.DriverName,
				Pool:                   resourceapi.ResourcePool{Name: nodeName, Generation: max(pool.Generation, 1), ResourceSliceCount: int64(len(pool.Slices))},
				NodeName:               ptr.To(nodeName),
				Devices:                s.Devices,
				SharedCounters:         s.SharedCounters,
				PerDeviceNodeSelection: s.PerDeviceNodeSelection,
				PartitionTypeAttribute: s.PartitionTypeAttribute,
				SkipNodeOperations:     s.SkipNodeOperations,
			},
		}
		if _, err := api.Create(ctx, slice, metav1.CreateOptions{}); err != nil {
			return i, fmt.Errorf("create slice %d of %d: %w", i+1, len(pool.Slices), err)
		}
	}
	klog.FromContext(ctx).V(2).Info("Published the node's slices directly; the ResourceSlice controller adopts them", "slices", len(pool.Slices))
	return len(pool.Slices), nil
}
