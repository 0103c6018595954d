package v1alpha1

// Merge folds configurations in the order DRA hands them to the driver —
// those from the DeviceClass first, then those from the claim, each in the
// order written — into one per kind: a later configuration's set fields
// replace an earlier one's (sharing as a whole). The result is validated
// again, since a combination can be invalid where each part was not.
func Merge(configs ...Config) (gpu *GpuConfig, mig *MigDeviceConfig) {
	for _, c := range configs {
		switch c := c.(type) {
		case *GpuConfig:
			if gpu == nil {
				gpu = &GpuConfig{TypeMeta: c.TypeMeta}
			}
			if c.Sharing != nil {
				gpu.Sharing = c.Sharing
			}
			if c.PowerLimitWatts != nil {
				gpu.PowerLimitWatts = c.PowerLimitWatts
			}
			if c.Graphics != nil {
				gpu.Graphics = c.Graphics
			}
		case *MigDeviceConfig:
			if mig == nil {
				mig = &MigDeviceConfig{TypeMeta: c.TypeMeta}
			}
			if c.Sharing != nil {
				mig.Sharing = c.Sharing
			}
		}
	}
	return gpu, mig
}
