package domain

import (
	resourceapi "k8s.io/api/resource/v1"
)

// Only the gang controller allocates domain channels (docs/gang.md, "Who
// allocates what"): every channel carries TaintKey with effect NoSchedule,
// so the scheduler's allocator never picks one for a claim that does not
// tolerate it, and the chart's admission policy refuses every claim that
// would. The controller tolerates it in its own search (Tolerating).
const TaintKey = "gang.tessera.dev/controller-allocated"

// Taint is the taint every domain channel carries.
func Taint() resourceapi.DeviceTaint {
	return resourceapi.DeviceTaint{Key: TaintKey, Effect: resourceapi.DeviceTaintEffectNoSchedule}
}

// Binding conditions the controller writes on a gang's domain channel
// allocation. The scheduler binds no pod using the claim (every member)
// until ConditionMembersAllocated is True on the channel's device status,
// and gives up on those waiting once ConditionPlacementFailed is True: the
// members start together or not at all.
const (
	ConditionMembersAllocated = "gang.tessera.dev/MembersAllocated"
	ConditionPlacementFailed  = "gang.tessera.dev/PlacementFailed"
)

// Tolerating is a copy of claim whose every request (and subrequest)
// tolerates TaintKey: what the controller allocates a domain claim with.
func Tolerating(claim *resourceapi.ResourceClaim) *resourceapi.ResourceClaim {
	c := claim.DeepCopy()
	t := resourceapi.DeviceToleration{Key: TaintKey, Operator: resourceapi.DeviceTolerationOpExists, Effect: resourceapi.DeviceTaintEffectNoSchedule}
	for i := range c.Spec.Devices.Requests {
		r := &c.Spec.Devices.Requests[i]
		if r.Exactly != nil {
			r.Exactly.Tolerations = append(r.Exactly.Tolerations, t)
		}
		for j := range r.FirstAvailable {
			r.FirstAvailable[j].Tolerations = append(r.FirstAvailable[j].Tolerations, t)
		}
	}
	return c
}
