package slices

import (
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/utils/ptr"

	"github.com/tessera-dev/tessera/driver/discovery"
	"github.com/tessera-dev/tessera/driver/inventory"
)

// Attributes of shared GPUs.
const (
	AttrTimeSliced   = "timeSliced"
	AttrMemoryShared = "memoryShared"
)

// MemoryStep is the granularity of memory shares: a claim's memory request
// is rounded up to it.
var MemoryStep = resource.MustParse("1Gi")

// share publishes a GPU that independent claims hold at once
// (allowMultipleAllocations) with consumable capacities, so that the
// scheduler counts what each claim takes and never hands out more than
// there is:
//   - timeSlices (time-sliced GPUs): N slices, one per claim unless it asks
//     for more;
//   - memory: on memory-shared GPUs a claim takes what it asks for in whole
//     GiB, and the whole GPU's memory if it asks for none (so a claim
//     unaware of sharing still gets a GPU to itself); on GPUs only time
//     sliced a claim takes no memory unless it asks.
func share(dev *resourceapi.Device, g discovery.GPU, s inventory.Share) {
	if !s.Shared() {
		return
	}
	dev.AllowMultipleAllocations = ptr.To(true)
	// Attributes name the mode so DeviceClasses can select it.
	if s.TimeSlices > 0 {
		dev.Attributes[AttrTimeSliced] = resourceapi.DeviceAttribute{BoolValue: ptr.To(true)}
	}
	if s.Memory {
		dev.Attributes[AttrMemoryShared] = resourceapi.DeviceAttribute{BoolValue: ptr.To(true)}
	}
	step := MemoryStep.Value()
	most := resource.NewQuantity(g.MemoryBytes/step*step, resource.BinarySI)
	mem := dev.Capacity[CapMemory]
	if s.Memory {
		mem.RequestPolicy = &resourceapi.CapacityRequestPolicy{
			Default:    most,
			ValidRange: &resourceapi.CapacityRequestPolicyRange{Min: ptr.To(MemoryStep.DeepCopy()), Max: most, Step: ptr.To(MemoryStep.DeepCopy())},
		}
	} else {
		zero := resource.NewQuantity(0, resource.BinarySI)
		mem.RequestPolicy = &resourceapi.CapacityRequestPolicy{
			Default:    zero,
			ValidRange: &resourceapi.CapacityRequestPolicyRange{Min: zero, Max: most, Step: ptr.To(MemoryStep.DeepCopy())},
		}
	}
	dev.Capacity[CapMemory] = mem
	if s.TimeSlices > 0 {
		one := resource.NewQuantity(1, resource.DecimalSI)
		dev.Capacity[CapTimeSlices] = resourceapi.DeviceCapacity{
			Value: *resource.NewQuantity(int64(s.TimeSlices), resource.DecimalSI),
			RequestPolicy: &resourceapi.CapacityRequestPolicy{
				Default:    one,
				ValidRange: &resourceapi.CapacityRequestPolicyRange{Min: one, Max: resource.NewQuantity(int64(s.TimeSlices), resource.DecimalSI), Step: one},
			},
		}
	}
}
