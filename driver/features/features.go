// Package features declares every feature gate of Tessera's components in one
// place, with its maturity and default, as Kubernetes components do.
package features

import (
	"k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/component-base/featuregate"
)

const (
	// DeviceHealth watches NVML events (XIDs, ECC errors, lost GPUs), taints
	// faulty devices in the published ResourceSlices and streams device health
	// to the kubelet.
	//
	// owner: tessera; beta: v0.1
	DeviceHealth featuregate.Feature = "DeviceHealth"

	// DynamicMIG publishes every MIG profile at every valid placement as a
	// partitionable device (shared counters per GPU) and creates the MIG
	// instance at prepare. Off: GPUs in MIG mode offer the MIG devices an
	// operator made, and Tessera never changes MIG configuration. Needs an
	// API server serving partitionable devices (DRAPartitionableDevices, on by
	// default since Kubernetes 1.36).
	//
	// owner: tessera; beta: v0.1
	DynamicMIG featuregate.Feature = "DynamicMIG"

	// LazyMIG publishes, under DynamicMIG, the partitions only of the GPUs
	// that hold one and of --mig-spare-gpus free ones, every whole GPU
	// always (driver/lazymig): the scheduler's cost per pod grows with the
	// devices a node publishes. A free GPU's partitions are withdrawn only
	// after --mig-withdraw-grace under a NoSchedule taint. Needs device
	// taints (DRADeviceTaints) on the API server and scheduler.
	//
	// owner: tessera; beta: v0.2
	LazyMIG featuregate.Feature = "LazyMIG"

	// DeviceMetadata writes, for each prepared claim's request, the
	// kubelet's device metadata file (KEP-5304) that the kubelet plugin
	// helper mounts into the claim's containers at
	// /var/run/kubernetes.io/dra-device-attributes/: each device's
	// attributes, what its prepare made (a partition's UUID, a share's
	// memory) and a gang member's rank and role (driver/devicemeta). Needs
	// a container runtime that applies CDI specs, as every claim does; no
	// Kubernetes feature gate.
	//
	// owner: tessera; beta: v0.3
	DeviceMetadata featuregate.Feature = "DeviceMetadata"
)

// defaults are the gates and their specs; add new gates here only.
var defaults = map[featuregate.Feature]featuregate.FeatureSpec{
	DeviceHealth:   {Default: true, PreRelease: featuregate.Beta},
	DynamicMIG:     {Default: true, PreRelease: featuregate.Beta},
	LazyMIG:        {Default: true, PreRelease: featuregate.Beta},
	DeviceMetadata: {Default: true, PreRelease: featuregate.Beta},
}

// New returns a gate set holding all of Tessera's gates at their defaults.
// Each component (and each test) owns its set: there is no global to mutate.
func New() featuregate.MutableFeatureGate {
	g := featuregate.NewFeatureGate()
	runtime.Must(g.Add(defaults))
	return g
}
