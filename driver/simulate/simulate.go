// Package simulate runs the kube-scheduler's own DRA allocator
// (k8s.io/dynamic-resource-allocation/structured) against a set of
// ResourceSlices and DeviceClasses, with the feature set Kubernetes 1.37
// enables by default. Tests use it to prove what the scheduler will do with
// the slices Tessera publishes; tools use it to explain why a claim waits.
package simulate

import (
	"context"
	"fmt"
	"sync"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"
)

// Features are the allocator features on by default in Kubernetes 1.37.
var Features = structured.Features{
	AdminAccess:            true,
	ConsumableCapacity:     true,
	DeviceBindingAndStatus: true,
	DeviceTaints:           true,
	PartitionableDevices:   true,
	PrioritizedList:        true,
}

// Cluster is the allocator's view of a cluster: classes, slices and what is
// already allocated. It is safe for concurrent use.
type Cluster struct {
	mu        sync.Mutex
	classes   map[string]*resourceapi.DeviceClass
	slices    []*resourceapi.ResourceSlice
	allocated sets.Set[structured.DeviceID]
	shared    sets.Set[structured.SharedDeviceID]
	capacity  structured.ConsumedCapacityCollection
	cache     *cel.Cache
}

// New returns a cluster with nothing allocated.
func New(classes []*resourceapi.DeviceClass, slices []*resourceapi.ResourceSlice) *Cluster {
	c := &Cluster{
		classes:   map[string]*resourceapi.DeviceClass{},
		slices:    slices,
		allocated: sets.New[structured.DeviceID](),
		shared:    sets.New[structured.SharedDeviceID](),
		capacity:  structured.NewConsumedCapacityCollection(),
		cache:     cel.NewCache(100, cel.Features{EnableConsumableCapacity: true}),
	}
	for _, dc := range classes {
		c.classes[dc.Name] = dc
	}
	return c
}

// Publish replaces the slices the allocator sees (a node republished);
// what is allocated stays.
func (c *Cluster) Publish(slices []*resourceapi.ResourceSlice) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.slices = slices
}

// Allocate asks the allocator to place claims on a node. It returns nil, nil
// when they do not fit; the results are not recorded until Commit.
func (c *Cluster) Allocate(ctx context.Context, nodeName string, claims ...*resourceapi.ResourceClaim) ([]resourceapi.AllocationResult, error) {
	node := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeName, Labels: map[string]string{"kubernetes.io/hostname": nodeName}}}
	return c.AllocateOnNode(ctx, node, claims...)
}

// AllocateOnNode is Allocate on a node object, whose labels the pools' node
// selectors are matched against.
func (c *Cluster) AllocateOnNode(ctx context.Context, node *v1.Node, claims ...*resourceapi.ResourceClaim) ([]resourceapi.AllocationResult, error) {
	c.mu.Lock()
	sl := c.slices
	c.mu.Unlock()
	return c.allocate(ctx, node, sl, claims)
}

// allocate runs the allocator over slices with what the cluster holds taken.
func (c *Cluster) allocate(ctx context.Context, node *v1.Node, slices []*resourceapi.ResourceSlice, claims []*resourceapi.ResourceClaim) ([]resourceapi.AllocationResult, error) {
	c.mu.Lock()
	state := structured.AllocatedState{
		AllocatedDevices:         c.allocated.Clone(),
		AllocatedSharedDeviceIDs: c.shared.Clone(),
		AggregatedCapacity:       c.capacity.Clone(),
	}
	c.mu.Unlock()
	alloc, err := structured.NewAllocator(ctx, Features, state, lister(c.classes), slices, c.cache)
	if err != nil {
		return nil, fmt.Errorf("create allocator: %w", err)
	}
	return alloc.Allocate(ctx, node, claims)
}

// Commit records allocation results as taken, as the scheduler does once it
// writes them to claims.
func (c *Cluster) Commit(results ...resourceapi.AllocationResult) {
	c.update(results, true)
}

// Release frees allocation results, as deleting their claims would.
func (c *Cluster) Release(results ...resourceapi.AllocationResult) {
	c.update(results, false)
}

// update marks each result's device (or its share and consumed capacity)
// taken or free. Admin-access results never take a device.
func (c *Cluster) update(results []resourceapi.AllocationResult, take bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, r := range results {
		for _, d := range r.Devices.Results {
			id := structured.MakeDeviceID(d.Driver, d.Pool, d.Device)
			switch {
			case d.ShareID != nil:
				share := structured.MakeSharedDeviceID(id, d.ShareID)
				var consumed structured.DeviceConsumedCapacity
				if d.ConsumedCapacity != nil {
					consumed = structured.NewDeviceConsumedCapacity(id, d.ConsumedCapacity)
				}
				if take {
					c.shared.Insert(share)
					if d.ConsumedCapacity != nil {
						c.capacity.Insert(consumed)
					}
				} else {
					c.shared.Delete(share)
					if d.ConsumedCapacity != nil {
						c.capacity.Remove(consumed)
					}
				}
			case d.AdminAccess != nil && *d.AdminAccess:
			case take:
				c.allocated.Insert(id)
			default:
				c.allocated.Delete(id)
			}
		}
	}
}

type lister map[string]*resourceapi.DeviceClass

func (l lister) List() ([]*resourceapi.DeviceClass, error) {
	out := make([]*resourceapi.DeviceClass, 0, len(l))
	for _, c := range l {
		out = append(out, c)
	}
	return out, nil
}

func (l lister) Get(name string) (*resourceapi.DeviceClass, error) {
	if c, ok := l[name]; ok {
		return c, nil
	}
	return nil, apierrors.NewNotFound(resourceapi.Resource("deviceclasses"), name)
}
