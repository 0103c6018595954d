package v1alpha1

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation/field"
	kjson "sigs.k8s.io/json"
)

// MaxConfigBytes is the API's limit for one opaque configuration.
const MaxConfigBytes = 10 * 1024

// Config is a decoded configuration: *GpuConfig or *MigDeviceConfig.
type Config interface{ isConfig() }

func (*GpuConfig) isConfig()       {}
func (*MigDeviceConfig) isConfig() {}

// Decode reads one opaque configuration strictly and validates it. Errors name
// the field below "parameters" (the opaque configuration's own field), the bad
// value and what is allowed; see DecodeAt.
func Decode(raw []byte) (Config, error) {
	cfg, errs := DecodeAt(raw, field.NewPath("parameters"))
	if len(errs) > 0 {
		return nil, errs.ToAggregate()
	}
	return cfg, nil
}

// DecodeAt reads one opaque configuration strictly and validates it, reporting
// every problem as a field error below path, where the configuration sits in
// its object (for the admission webhook:
// spec.devices.config[1].opaque.parameters), so that messages name the full
// field. Strict means as the API server decodes its own objects: field names
// match case-sensitively, and unknown or duplicate fields, wrong JSON types
// and unknown kinds are errors.
func DecodeAt(raw []byte, path *field.Path) (Config, field.ErrorList) {
	if len(raw) > MaxConfigBytes {
		return nil, field.ErrorList{field.TooLong(path, "", MaxConfigBytes)}
	}
	var meta struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
	}
	if err := json.Unmarshal(raw, &meta); err != nil {
		return nil, field.ErrorList{field.Invalid(path, field.OmitValueType{}, fmt.Sprintf("configuration is not a JSON object: %v", err))}
	}
	if meta.APIVersion != Group+"/"+Version {
		return nil, field.ErrorList{field.NotSupported(path.Child("apiVersion"), meta.APIVersion, []string{Group + "/" + Version})}
	}
	var cfg Config
	switch meta.Kind {
	case GpuConfigKind:
		cfg = &GpuConfig{}
	case MigDeviceConfigKind:
		cfg = &MigDeviceConfig{}
	default:
		return nil, field.ErrorList{field.NotSupported(path.Child("kind"), meta.Kind, []string{GpuConfigKind, MigDeviceConfigKind})}
	}
	// sigs.k8s.io/json is the API server's own strict decoder: unlike
	// encoding/json it reports where an unknown field sits, not only its name.
	strict, err := kjson.UnmarshalStrict(raw, cfg, kjson.DisallowUnknownFields, kjson.DisallowDuplicateFields)
	if err != nil {
		return nil, field.ErrorList{decodeError(meta.Kind, err, path)}
	}
	if len(strict) > 0 {
		var errs field.ErrorList
		for _, e := range strict {
			errs = append(errs, strictError(meta.Kind, e, path))
		}
		return nil, errs
	}
	if errs := validate(cfg, path); len(errs) > 0 {
		return nil, errs
	}
	return cfg, nil
}

// jsonPath turns a decoder's dotted field path ("sharing.mpsConfig") into a
// field path below root.
func jsonPath(root *field.Path, dotted string) *field.Path {
	p := root
	for name := range strings.SplitSeq(dotted, ".") {
		p = p.Child(name)
	}
	return p
}

// decodeError names the offending field of a JSON decoding error.
func decodeError(kind string, err error, path *field.Path) *field.Error {
	var typeErr *json.UnmarshalTypeError
	if errors.As(err, &typeErr) && typeErr.Field != "" {
		return field.TypeInvalid(jsonPath(path, typeErr.Field), field.OmitValueType{},
			fmt.Sprintf("got JSON %s, want %s (see the %s API, %s/%s)", typeErr.Value, typeErr.Type, kind, Group, Version))
	}
	// A value's own decoder failed (a quantity such as "10 gigs"), or the
	// JSON is malformed.
	return field.Invalid(path, field.OmitValueType{}, fmt.Sprintf("cannot decode as %s: %v", kind, err))
}

// strictError turns an unknown or duplicate field into a field error.
func strictError(kind string, err error, path *field.Path) *field.Error {
	fe, ok := err.(kjson.FieldError)
	if !ok {
		return field.Invalid(path, field.OmitValueType{}, err.Error())
	}
	p := jsonPath(path, fe.FieldPath())
	name := fe.FieldPath()[strings.LastIndex(fe.FieldPath(), ".")+1:]
	if strings.HasPrefix(err.Error(), "duplicate field") {
		return field.Forbidden(p, fmt.Sprintf("duplicate field %q: give it once", name))
	}
	return field.Forbidden(p, fmt.Sprintf("unknown field %q: check its spelling (names are case-sensitive) against the %s API (%s/%s)", name, kind, Group, Version))
}

// Validate checks a configuration's values; error paths start at the
// configuration's root ("sharing.strategy").
func Validate(cfg Config) field.ErrorList { return validate(cfg, nil) }

// validate checks a configuration's values, with error paths below root.
func validate(cfg Config, root *field.Path) field.ErrorList {
	switch c := cfg.(type) {
	case *GpuConfig:
		var errs field.ErrorList
		errs = append(errs, validateSharing(c.Sharing, root.Child("sharing"), true)...)
		if c.PowerLimitWatts != nil && (*c.PowerLimitWatts < 1 || *c.PowerLimitWatts > 5000) {
			errs = append(errs, field.Invalid(root.Child("powerLimitWatts"), *c.PowerLimitWatts, "must be between 1 and 5000 watts (and within the GPU's powerMinWatts..powerMaxWatts)"))
		}
		return errs
	case *MigDeviceConfig:
		return validateSharing(c.Sharing, root.Child("sharing"), false)
	}
	return field.ErrorList{field.InternalError(root, fmt.Errorf("unknown configuration type %T", cfg))}
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
		case "", DefaultTimeSlice:
		case ShortTimeSlice, MediumTimeSlice, LongTimeSlice:
			// Kept in the API for when NVML offers the call; refused
			// rather than ignored until then.
			errs = append(errs, field.Invalid(p.Child("interval"), s.TimeSlicingConfig.Interval, "cannot be applied: NVML has no call that sets the compute time-slice length (nvidia-smi uses a private driver interface, and Tessera runs no host binaries); use Default or leave it out"))
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
