// Package v1alpha1 holds the opaque device configuration users and operators
// attach to Tessera claims and DeviceClasses (group gpu.tessera.dev, version
// v1alpha1): how a GPU or MIG device is shared and what power it may draw.
// It decodes strictly and validates with errors that name the field and the
// allowed values; the kubelet plugin and the webhook use the same code. It
// imports nothing of Tessera's.
package v1alpha1

import (
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Group and Version of the configuration API.
const (
	Group   = "gpu.tessera.dev"
	Version = "v1alpha1"
)

// Kinds.
const (
	GpuConfigKind       = "GpuConfig"
	MigDeviceConfigKind = "MigDeviceConfig"
)

// GpuConfig configures whole GPUs.
type GpuConfig struct {
	metav1.TypeMeta `json:",inline"`
	// Sharing says how the containers and pods given this GPU share it.
	Sharing *Sharing `json:"sharing,omitempty"`
	// PowerLimitWatts caps the GPU's board power while the claim holds it;
	// the previous limit is restored at unprepare. Within the GPU's
	// powerMinWatts..powerMaxWatts attributes.
	PowerLimitWatts *int32 `json:"powerLimitWatts,omitempty"`
	// Graphics gives the containers the driver's OpenGL, EGL and Vulkan
	// libraries and /dev/nvidia-modeset besides CUDA's; off by default, as
	// compute workloads need none of it.
	Graphics *bool `json:"graphics,omitempty"`
}

// MigDeviceConfig configures MIG devices.
type MigDeviceConfig struct {
	metav1.TypeMeta `json:",inline"`
	// Sharing says how the containers and pods given this MIG device share
	// it. TimeSlicing is not available on MIG devices.
	Sharing *Sharing `json:"sharing,omitempty"`
}

// SharingStrategy names a way of sharing a device.
type SharingStrategy string

const (
	// Exclusive: one container process tree at a time (the default).
	Exclusive SharingStrategy = "Exclusive"
	// TimeSlicing: all users run, the GPU switches between them.
	TimeSlicing SharingStrategy = "TimeSlicing"
	// MPS: all users run concurrently through an MPS control daemon.
	MPS SharingStrategy = "MPS"
)

// Sharing is a sharing strategy with its settings.
type Sharing struct {
	Strategy          SharingStrategy    `json:"strategy"`
	TimeSlicingConfig *TimeSlicingConfig `json:"timeSlicingConfig,omitempty"`
	MPSConfig         *MPSConfig         `json:"mpsConfig,omitempty"`
}

// TimeSliceInterval is the length of a time slice.
type TimeSliceInterval string

const (
	DefaultTimeSlice TimeSliceInterval = "Default"
	ShortTimeSlice   TimeSliceInterval = "Short"
	MediumTimeSlice  TimeSliceInterval = "Medium"
	LongTimeSlice    TimeSliceInterval = "Long"
)

// TimeSlicingConfig tunes time-slicing.
type TimeSlicingConfig struct {
	Interval TimeSliceInterval `json:"interval,omitempty"`
}

// MPSConfig tunes MPS.
type MPSConfig struct {
	// DefaultActiveThreadPercentage limits each client's share of the
	// GPU's streaming multiprocessors, 1-100.
	DefaultActiveThreadPercentage *int32 `json:"defaultActiveThreadPercentage,omitempty"`
	// DefaultPinnedDeviceMemoryLimit limits each client's device memory.
	DefaultPinnedDeviceMemoryLimit *resource.Quantity `json:"defaultPinnedDeviceMemoryLimit,omitempty"`
	// DefaultPerDevicePinnedMemoryLimit overrides the memory limit per
	// device, keyed by the device's index within the claim ("0", "1", ...).
	DefaultPerDevicePinnedMemoryLimit map[string]resource.Quantity `json:"defaultPerDevicePinnedMemoryLimit,omitempty"`
}
