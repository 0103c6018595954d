package simulate

import (
	"context"
	"fmt"
	"slices"
	"strings"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/structured"
)

// pinDomain holds the attributes Refit adds to the devices a claim's results
// name, so that a selector can confine each request to them. Nothing
// publishes attributes under it.
const pinDomain = "refit.simulate.tessera.dev"

// Refit says whether a claim that is allocated already (by another
// allocator, or written before a re-check) still fits beside everything
// the cluster holds as taken. The allocator places the claim afresh with
// each request confined to the devices its results name, so exclusive use,
// shared counters (a whole GPU against its partitions) and consumable
// capacity (time slices, memory shares) are judged exactly as the
// scheduler judges them. A claim that fits is committed with its written
// results (share IDs included), so the next one is judged beside it.
//
// node is where the claim's allocation points (its pools' slices must
// match it as they did for the allocator). A claim without allocation, or
// with admin-access results only, fits.
func (c *Cluster) Refit(ctx context.Context, node *v1.Node, claim *resourceapi.ResourceClaim) (bool, error) {
	return c.refit(ctx, node, claim, false)
}

// RefitHeld is Refit for a claim whose allocation is in the API already,
// judged as its holder: its devices without taints (they keep the
// allocator from a device, they take nothing from a claim that holds it;
// the kubelet plugin prepares it all the same, and NoExecute evicts
// through the upstream controller, not here) and without counters of no
// room (nothing can draw on them, so they hold no contention between
// claims, only a publisher's "allocate no more of these", as on a lazily
// published partition being withdrawn). Refit, for a plan not yet
// allocated, keeps both.
func (c *Cluster) RefitHeld(ctx context.Context, node *v1.Node, claim *resourceapi.ResourceClaim) (bool, error) {
	return c.refit(ctx, node, claim, true)
}

func (c *Cluster) refit(ctx context.Context, node *v1.Node, claim *resourceapi.ResourceClaim, asHolder bool) (bool, error) {
	alloc := claim.Status.Allocation
	if alloc == nil {
		return true, nil
	}
	pinned, keys := pin(claim)
	if len(keys) == 0 {
		return true, nil
	}
	type poolID struct{ driver, pool string }
	pins := map[structured.DeviceID][]string{} // device -> the pin attributes it carries
	pools := map[poolID]bool{}
	for _, r := range alloc.Devices.Results {
		if admin(r) {
			continue
		}
		id := structured.MakeDeviceID(r.Driver, r.Pool, r.Device)
		attr := keys[r.Request]
		if !slices.Contains(pins[id], attr) {
			pins[id] = append(pins[id], attr)
		}
		pools[poolID{r.Driver, r.Pool}] = true
	}
	var confined []*resourceapi.ResourceSlice
	c.mu.Lock()
	published := c.slices
	c.mu.Unlock()
	// Counters of no room, by pool and counter set (RefitHeld).
	empty := map[poolID]map[string]map[string]bool{}
	for _, s := range published {
		id := poolID{s.Spec.Driver, s.Spec.Pool.Name}
		if !asHolder || !pools[id] {
			continue
		}
		for _, set := range s.Spec.SharedCounters {
			for name, counter := range set.Counters {
				if counter.Value.IsZero() {
					if empty[id] == nil {
						empty[id] = map[string]map[string]bool{}
					}
					if empty[id][set.Name] == nil {
						empty[id][set.Name] = map[string]bool{}
					}
					empty[id][set.Name][name] = true
				}
			}
		}
	}
	for _, s := range published {
		id := poolID{s.Spec.Driver, s.Spec.Pool.Name}
		if !pools[id] {
			continue
		}
		s = s.DeepCopy()
		for i := range s.Spec.Devices {
			d := &s.Spec.Devices[i]
			held := pins[structured.MakeDeviceID(s.Spec.Driver, s.Spec.Pool.Name, d.Name)]
			if asHolder && len(held) > 0 {
				asHeld(d, empty[id])
			}
			for _, attr := range held {
				if d.Attributes == nil {
					d.Attributes = map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{}
				}
				t := true
				d.Attributes[resourceapi.QualifiedName(pinDomain+"/"+attr)] = resourceapi.DeviceAttribute{BoolValue: &t}
			}
		}
		confined = append(confined, s)
	}
	res, err := c.allocate(ctx, node, confined, []*resourceapi.ResourceClaim{pinned})
	if err != nil {
		return false, fmt.Errorf("re-check allocation of claim %s/%s: %w", claim.Namespace, claim.Name, err)
	}
	if res == nil {
		return false, nil
	}
	c.Commit(*alloc)
	return true, nil
}

// asHeld is a device as the claim that holds it needs it (RefitHeld): no
// taints, and no counters of no room (empty: counter set -> counter).
func asHeld(d *resourceapi.Device, empty map[string]map[string]bool) {
	d.Taints = nil
	for i := range d.ConsumesCounters {
		cc := &d.ConsumesCounters[i]
		for name := range cc.Counters {
			if empty[cc.CounterSet][name] {
				delete(cc.Counters, name)
			}
		}
	}
}

// pin returns a claim asking, per request named in the claim's results,
// for exactly as many devices as it got, each carrying that request's pin
// attribute; keys maps a result's request ("req" or "req/sub") to the
// attribute. Constraints and configs are left out: they do not take
// anything a neighbour could need.
func pin(claim *resourceapi.ResourceClaim) (*resourceapi.ResourceClaim, map[string]string) {
	keys := map[string]string{}
	counts := map[string]int64{}
	var order []string
	for _, r := range claim.Status.Allocation.Devices.Results {
		if admin(r) {
			continue
		}
		if _, ok := keys[r.Request]; !ok {
			keys[r.Request] = fmt.Sprintf("r%d", len(order))
			order = append(order, r.Request)
		}
		counts[r.Request]++
	}
	out := &resourceapi.ResourceClaim{ObjectMeta: *claim.ObjectMeta.DeepCopy()}
	for _, key := range order {
		spec := requestSpec(claim, key)
		req := resourceapi.ExactDeviceRequest{AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: counts[key]}
		if spec != nil {
			req.DeviceClassName = spec.DeviceClassName
			req.Selectors = append(req.Selectors, spec.Selectors...)
			req.Tolerations = spec.Tolerations
			req.Capacity = spec.Capacity
		}
		req.Selectors = append(req.Selectors, resourceapi.DeviceSelector{CEL: &resourceapi.CELDeviceSelector{
			Expression: fmt.Sprintf("%q in device.attributes[%q]", keys[key], pinDomain),
		}})
		out.Spec.Devices.Requests = append(out.Spec.Devices.Requests, resourceapi.DeviceRequest{Name: keys[key], Exactly: &req})
	}
	return out, keys
}

// requestSpec finds what a result's request ("req", or "req/sub" of a
// prioritized list) asked for; nil when the claim no longer names it.
func requestSpec(claim *resourceapi.ResourceClaim, key string) *resourceapi.ExactDeviceRequest {
	name, sub, _ := strings.Cut(key, "/")
	for _, r := range claim.Spec.Devices.Requests {
		if r.Name != name {
			continue
		}
		if sub == "" {
			return r.Exactly
		}
		for _, s := range r.FirstAvailable {
			if s.Name == sub {
				return &resourceapi.ExactDeviceRequest{
					DeviceClassName: s.DeviceClassName, Selectors: s.Selectors,
					Tolerations: s.Tolerations, Capacity: s.Capacity,
				}
			}
		}
	}
	return nil
}

func admin(r resourceapi.DeviceRequestAllocationResult) bool {
	return r.AdminAccess != nil && *r.AdminAccess
}
