package v1alpha1

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation/field"
)

// MaxConfigBytes is the API's limit for one opaque configuration.
const MaxConfigBytes = 10 * 1024

// Config is a decoded configuration: *GpuConfig or *MigDeviceConfig.
type Config interface{ isConfig() }

func (*GpuConfig) isConfig()       {}
func (*MigDeviceConfig) isConfig() {}

// Decode reads one opaque configuration strictly: unknown fields, wrong types
// and unknown kinds are errors naming the field; the result is validated.
func Decode(raw []byte) (Config, error) {
	if len(raw) > MaxConfigBytes {
		return nil, fmt.Errorf("configuration is %d bytes; the API allows %d", len(raw), MaxConfigBytes)
	}
	var meta struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
	}
	if err := json.Unmarshal(raw, &meta); err != nil {
		return nil, fmt.Errorf("configuration is not a JSON object: %v", err)
	}
	if meta.APIVersion != Group+"/"+Version {
		return nil, field.NotSupported(field.NewPath("apiVersion"), meta.APIVersion, []string{Group + "/" + Version})
	}
	var cfg Config
	switch meta.Kind {
	case GpuConfigKind:
		cfg = &GpuConfig{}
	case MigDeviceConfigKind:
		cfg = &MigDeviceConfig{}
	default:
		return nil, field.NotSupported(field.NewPath("kind"), meta.Kind, []string{GpuConfigKind, MigDeviceConfigKind})
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	if err := dec.Decode(cfg); err != nil {
		return nil, decodeError(meta.Kind, err)
	}
	if errs := Validate(cfg); len(errs) > 0 {
		return nil, fmt.Errorf("%s: %w", meta.Kind, errs.ToAggregate())
	}
	return cfg, nil
}

// decodeError names the offending field of a JSON decoding error.
func decodeError(kind string, err error) error {
	var typeErr *json.UnmarshalTypeError
	if errors.As(err, &typeErr) {
		return fmt.Errorf("%s: field %s: got JSON %s, want %s", kind, typeErr.Field, typeErr.Value, typeErr.Type)
	}
	msg := err.Error()
	if rest, ok := strings.CutPrefix(msg, "json: unknown field "); ok {
		name, _ := strconv.Unquote(rest)
		return fmt.Errorf("%s: unknown field %q: check its spelling against the %s API (gpu.tessera.dev/v1alpha1)", kind, name, kind)
	}
	return fmt.Errorf("%s: %v", kind, err)
}

// Validate checks a configuration's values.
func Validate(cfg Config) field.ErrorList {
	switch c := cfg.(type) {
	case *GpuConfig:
		var errs field.ErrorList
		errs = append(errs, validateSharing(c.Sharing, field.NewPath("sharing"), true)...)
		if c.PowerLimitWatts != nil && (*c.PowerLimitWatts < 1 || *c.PowerLimitWatts > 5000) {
			errs = append(errs, field.Invalid(field.NewPath("powerLimitWatts"), *c.PowerLimitWatts, "must be between 1 and 5000 watts (and within the GPU's powerMinWatts..powerMaxWatts)"))
		}
		return errs
	case *MigDeviceConfig:
		return validateSharing(c.Sharing, field.NewPath("sharing"), false)
	}
	return field.ErrorList{field.InternalError(nil, fmt.Errorf("unknown configuration type %T", cfg))}
}

func validateSharing(s *Sharing, path *field.Path, timeSlicing bool) field.ErrorList {
	if s == nil {
		return nil
	}
	var errs field.ErrorList
	allowed := []string{string(Exclusive), string(MPS)}
	if timeSlicing {
		allowed = []string{string(Exclusive), string(TimeSlicing), string(MPS)}
	}
	switch s.Strategy {
	case Exclusive:
	case TimeSlicing:
		if !timeSlicing {
			errs = append(errs, field.NotSupported(path.Child("strategy"), s.Strategy, allowed))
		}
	case MPS:
	default:
		errs = append(errs, field.NotSupported(path.Child("strategy"), s.Strategy, allowed))
	}
	if s.TimeSlicingConfig != nil {
		p := path.Child("timeSlicingConfig")
		if s.Strategy != TimeSlicing {
			errs = append(errs, field.Forbidden(p, "only with strategy TimeSlicing"))
		}
		switch s.TimeSlicingConfig.Interval {
		case "", DefaultTimeSlice, ShortTimeSlice, MediumTimeSlice, LongTimeSlice:
		default:
			errs = append(errs, field.NotSupported(p.Child("interval"), s.TimeSlicingConfig.Interval, []string{string(DefaultTimeSlice), string(ShortTimeSlice), string(MediumTimeSlice), string(LongTimeSlice)}))
		}
	}
	if m := s.MPSConfig; m != nil {
		p := path.Child("mpsConfig")
		if s.Strategy != MPS {
			errs = append(errs, field.Forbidden(p, "only with strategy MPS"))
		}
		if m.DefaultActiveThreadPercentage != nil && (*m.DefaultActiveThreadPercentage < 1 || *m.DefaultActiveThreadPercentage > 100) {
			errs = append(errs, field.Invalid(p.Child("defaultActiveThreadPercentage"), *m.DefaultActiveThreadPercentage, "must be between 1 and 100"))
		}
		if q := m.DefaultPinnedDeviceMemoryLimit; q != nil && q.Sign() <= 0 {
			errs = append(errs, field.Invalid(p.Child("defaultPinnedDeviceMemoryLimit"), q.String(), "must be a positive quantity such as 10Gi"))
		}
		for k, q := range m.DefaultPerDevicePinnedMemoryLimit {
			kp := p.Child("defaultPerDevicePinnedMemoryLimit").Key(k)
			if n, err := strconv.Atoi(k); err != nil || n < 0 {
				errs = append(errs, field.Invalid(kp, k, "keys are device indexes within the claim: 0, 1, ..."))
			}
			if q.Sign() <= 0 {
				errs = append(errs, field.Invalid(kp, q.String(), "must be a positive quantity such as 10Gi"))
			}
		}
	}
	return errs
}
