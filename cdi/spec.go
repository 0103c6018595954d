// Package cdi turns "these devices for this claim" into one CDI spec file per
// claim; it knows nothing of Kubernetes or NVML: plain structs in, files out.
package cdi

import (
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"unicode"
	"unicode/utf8"

	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"
	"tags.cncf.io/container-device-interface/pkg/parser"
	cdispec "tags.cncf.io/container-device-interface/specs-go"
)

const (
	// Vendor is the CDI vendor of every device this package writes.
	Vendor = "gpu.tessera.dev"
	// Class is the CDI class of every device this package writes.
	Class = "gpu"
	// Kind is the CDI kind ("vendor/class") of every spec this package writes.
	Kind = Vendor + "/" + Class
)

// Annotations that carry the claim identity and the driver's device names
// inside each spec, so that List can rebuild what Write was given.
const (
	annotationClaimUID       = Vendor + "/claim-uid"
	annotationClaimNamespace = Vendor + "/claim-namespace"
	annotationClaimName      = Vendor + "/claim-name"
	annotationDeviceName     = Vendor + "/device-name"
	annotationBootID         = Vendor + "/boot-id"
	annotationClaimRecord    = Vendor + "/claim-record"
)

// maxRecordLen bounds ClaimSpec.Record: CDI allows a spec's annotations
// 256 KiB in all, keys and the other values included.
const maxRecordLen = 128 << 10

// maxClaimUIDLen keeps the spec file name well under the 255-byte limit.
const maxClaimUIDLen = 128

// mountOptions are the options of every mount: read-only, recursive bind.
var mountOptions = []string{"ro", "nosuid", "nodev", "rbind"}

// DeviceNode is a character device to create in the container. It is always
// fully specified (type "c", major, minor) so that the runtime never needs to
// stat HostPath; HostPath may be a regular file (fake nodes) or empty (same as
// Path).
type DeviceNode struct {
	Path     string // path inside the container, e.g. /dev/nvidia0
	HostPath string // path on the host; empty means Path
	Major    int64  // must be > 0
	Minor    int64
}

// Mount is a read-only bind mount of a host file or directory.
type Mount struct {
	HostPath      string
	ContainerPath string
}

// CreateContainer is the OCI hook a CDI hook of this package runs as: in the
// container's namespaces once its mounts are made, before its process
// starts.
const CreateContainer = "createContainer"

// Hook is an OCI hook the runtime runs for the container.
type Hook struct {
	// Name is the OCI hook point; CreateContainer.
	Name string
	// Path is the program's path on the host.
	Path string
	// Args are the whole command line, the program's name first.
	Args []string
	// Timeout is how many seconds the runtime lets the hook run before it
	// kills it and fails the container's creation; 0 sets none.
	Timeout int
}

// Device is one device of a claim, named as the driver names it (e.g. "gpu-3"
// or "gpu-3-mig-1g.10gb-0"), with the edits that inject it.
type Device struct {
	Name        string
	DeviceNodes []DeviceNode
	Env         []string // KEY=VALUE
}

// Edits are container edits shared by all devices of a claim.
type Edits struct {
	DeviceNodes []DeviceNode
	Env         []string // KEY=VALUE
	Mounts      []Mount
	Hooks       []Hook
}

// ClaimSpec is everything the CDI spec of one claim holds.
type ClaimSpec struct {
	ClaimUID       string
	ClaimNamespace string
	ClaimName      string
	// BootID is the boot the spec was written in. A spec only holds within
	// it; one found after a reboot is stale, wherever the CDI directory
	// lives. Empty in specs of releases that did not record it.
	BootID string
	// Record is the writer's own record of the claim, kept in the spec as
	// an annotation and read back by List as written: this package never
	// interprets it. Empty in specs of releases that did not write one.
	Record string
	// Devices hold per-device edits, in the order given.
	Devices []Device
	// Common edits apply once when any device of the claim is injected:
	// control device nodes, claim-level env, driver library and tool mounts.
	// When two claims go into one container, node paths and mounts merge,
	// but an env key both set takes the value of the claim the runtime
	// injects last: claim-level env values do not add up across claims.
	Common Edits
}

// DeviceID returns the fully-qualified CDI device ID of a device of a claim.
// The claim UID makes it unique across claims and never reused, which matters
// because runtimes cache specs.
func DeviceID(claimUID, deviceName string) string {
	return parser.QualifiedName(Vendor, Class, cdiDeviceName(claimUID, deviceName))
}

func cdiDeviceName(claimUID, deviceName string) string {
	return claimUID + "-" + deviceName
}

func (c ClaimSpec) String() string {
	return fmt.Sprintf("claim %s/%s (%s)", c.ClaimNamespace, c.ClaimName, c.ClaimUID)
}

// toCDI validates spec and builds the CDI spec of the given kind for it, at
// the lowest CDI version its content needs.
func (c ClaimSpec) toCDI(kind string) (*cdispec.Spec, error) {
	if err := validateClaimUID(c.ClaimUID); err != nil {
		return nil, err
	}
	if err := validateText("claim namespace", c.ClaimNamespace, true); err != nil {
		return nil, err
	}
	if err := validateText("claim name", c.ClaimName, true); err != nil {
		return nil, err
	}
	if len(c.Devices) == 0 {
		return nil, errors.New("no devices; a CDI spec needs at least one")
	}
	common, err := c.Common.toCDI()
	if err != nil {
		return nil, fmt.Errorf("common edits: %w", err)
	}
	raw := &cdispec.Spec{
		Kind: kind,
		Annotations: map[string]string{
			annotationClaimUID:       c.ClaimUID,
			annotationClaimNamespace: c.ClaimNamespace,
			annotationClaimName:      c.ClaimName,
		},
		ContainerEdits: common,
	}
	if c.BootID != "" {
		if err := validateText("boot ID", c.BootID, true); err != nil {
			return nil, err
		}
		raw.Annotations[annotationBootID] = c.BootID
	}
	if c.Record != "" {
		if len(c.Record) > maxRecordLen {
			return nil, fmt.Errorf("claim record is %d bytes, more than the %d a CDI spec's annotations can carry", len(c.Record), maxRecordLen)
		}
		// Checked as any text, but not quoted in the error: it may be long.
		if err := validateText("claim record", c.Record, true); err != nil {
			return nil, errors.New("claim record is not valid UTF-8 or has a control character")
		}
		raw.Annotations[annotationClaimRecord] = c.Record
	}
	seen := make(map[string]bool, len(c.Devices))
	for _, d := range c.Devices {
		if seen[d.Name] {
			return nil, fmt.Errorf("device %q is listed twice", d.Name)
		}
		seen[d.Name] = true
		dev, err := d.toCDI(c.ClaimUID)
		if err != nil {
			return nil, fmt.Errorf("device %q: %w", d.Name, err)
		}
		raw.Devices = append(raw.Devices, dev)
	}
	raw.Version, err = cdispec.MinimumRequiredVersion(raw)
	if err != nil {
		return nil, fmt.Errorf("choose CDI version: %w", err)
	}
	return raw, nil
}

func (d Device) toCDI(claimUID string) (cdispec.Device, error) {
	if err := parser.ValidateDeviceName(d.Name); err != nil {
		return cdispec.Device{}, fmt.Errorf("bad device name: %w", err)
	}
	if len(d.DeviceNodes) == 0 && len(d.Env) == 0 {
		return cdispec.Device{}, errors.New("no device nodes and no env; CDI needs at least one edit per device")
	}
	edits, err := Edits{DeviceNodes: d.DeviceNodes, Env: d.Env}.toCDI()
	if err != nil {
		return cdispec.Device{}, err
	}
	return cdispec.Device{
		Name:           cdiDeviceName(claimUID, d.Name),
		Annotations:    map[string]string{annotationDeviceName: d.Name},
		ContainerEdits: edits,
	}, nil
}

func (e Edits) toCDI() (cdispec.ContainerEdits, error) {
	var out cdispec.ContainerEdits
	if err := cdiapi.ValidateEnv(e.Env); err != nil {
		return out, fmt.Errorf("%w; env entries are KEY=VALUE", err)
	}
	for _, v := range e.Env {
		if err := validateText("env entry", v, true); err != nil {
			return out, err
		}
	}
	out.Env = append(out.Env, e.Env...)
	for _, n := range e.DeviceNodes {
		if err := validatePath("device node path", n.Path, false); err != nil {
			return out, err
		}
		if err := validatePath("device node host path", n.HostPath, true); err != nil {
			return out, err
		}
		if n.Major <= 0 || n.Minor < 0 {
			return out, fmt.Errorf("device node %s: major %d, minor %d: major must be > 0 and minor >= 0 so the runtime need not stat the node", n.Path, n.Major, n.Minor)
		}
		out.DeviceNodes = append(out.DeviceNodes, &cdispec.DeviceNode{
			Path:     n.Path,
			HostPath: n.HostPath,
			Type:     "c",
			Major:    n.Major,
			Minor:    n.Minor,
		})
	}
	for _, m := range e.Mounts {
		if err := validatePath("mount host path", m.HostPath, false); err != nil {
			return out, err
		}
		if err := validatePath("mount container path", m.ContainerPath, false); err != nil {
			return out, err
		}
		out.Mounts = append(out.Mounts, &cdispec.Mount{
			HostPath:      m.HostPath,
			ContainerPath: m.ContainerPath,
			Options:       append([]string(nil), mountOptions...),
			Type:          "bind",
		})
	}
	for _, h := range e.Hooks {
		if h.Name != CreateContainer {
			return out, fmt.Errorf("hook %s: hook point %q; only %s hooks are written", h.Path, h.Name, CreateContainer)
		}
		if err := validatePath("hook path", h.Path, false); err != nil {
			return out, err
		}
		for _, a := range h.Args {
			if err := validateText("hook argument", a, false); err != nil {
				return out, err
			}
		}
		if h.Timeout < 0 {
			return out, fmt.Errorf("hook %s: timeout %d s; want 0 (none) or more", h.Path, h.Timeout)
		}
		hook := &cdispec.Hook{HookName: h.Name, Path: h.Path, Args: append([]string(nil), h.Args...)}
		if h.Timeout > 0 {
			hook.Timeout = &h.Timeout
		}
		out.Hooks = append(out.Hooks, hook)
	}
	return out, nil
}

// fromCDI rebuilds the ClaimSpec that Write turned into raw, a spec of the
// given kind. It is the inverse of toCDI for every spec that toCDI accepts.
func fromCDI(raw *cdispec.Spec, kind string) (ClaimSpec, error) {
	if raw.Kind != kind {
		return ClaimSpec{}, fmt.Errorf("kind %q, want %q", raw.Kind, kind)
	}
	c := ClaimSpec{
		ClaimUID:       raw.Annotations[annotationClaimUID],
		ClaimNamespace: raw.Annotations[annotationClaimNamespace],
		ClaimName:      raw.Annotations[annotationClaimName],
		BootID:         raw.Annotations[annotationBootID],
		Record:         raw.Annotations[annotationClaimRecord],
		Common:         fromCDIEdits(raw.ContainerEdits),
	}
	if c.ClaimUID == "" {
		return ClaimSpec{}, fmt.Errorf("no %s annotation", annotationClaimUID)
	}
	for _, d := range raw.Devices {
		name := d.Annotations[annotationDeviceName]
		if want := cdiDeviceName(c.ClaimUID, name); name == "" || d.Name != want {
			return ClaimSpec{}, fmt.Errorf("CDI device %q: annotation %s=%q does not match its name", d.Name, annotationDeviceName, name)
		}
		e := fromCDIEdits(d.ContainerEdits)
		c.Devices = append(c.Devices, Device{Name: name, DeviceNodes: e.DeviceNodes, Env: e.Env})
	}
	return c, nil
}

func fromCDIEdits(e cdispec.ContainerEdits) Edits {
	var out Edits
	out.Env = append(out.Env, e.Env...)
	for _, n := range e.DeviceNodes {
		out.DeviceNodes = append(out.DeviceNodes, DeviceNode{Path: n.Path, HostPath: n.HostPath, Major: n.Major, Minor: n.Minor})
	}
	for _, m := range e.Mounts {
		out.Mounts = append(out.Mounts, Mount{HostPath: m.HostPath, ContainerPath: m.ContainerPath})
	}
	for _, h := range e.Hooks {
		hook := Hook{Name: h.HookName, Path: h.Path, Args: h.Args}
		if h.Timeout != nil {
			hook.Timeout = *h.Timeout
		}
		out.Hooks = append(out.Hooks, hook)
	}
	return out
}

// validateClaimUID accepts what can be both part of a CDI device name and of
// a file name: ASCII letters, digits, '-', '_' and '.', starting and ending
// with a letter or digit. Kubernetes UIDs (UUIDs) always qualify.
func validateClaimUID(uid string) error {
	if uid == "" {
		return errors.New("empty claim UID")
	}
	if len(uid) > maxClaimUIDLen {
		return fmt.Errorf("claim UID %.20q... is longer than %d bytes", uid, maxClaimUIDLen)
	}
	for _, r := range uid {
		if !parser.IsAlphaNumeric(r) && r != '-' && r != '_' && r != '.' {
			return fmt.Errorf("claim UID %q: character %q not allowed; use letters, digits, '-', '_', '.'", uid, r)
		}
	}
	if !parser.IsAlphaNumeric(rune(uid[0])) || !parser.IsAlphaNumeric(rune(uid[len(uid)-1])) {
		return fmt.Errorf("claim UID %q must start and end with a letter or digit", uid)
	}
	return nil
}

// validateText rejects what would not survive a JSON round trip unchanged or
// would confuse a runtime: invalid UTF-8 and control characters.
func validateText(what, s string, required bool) error {
	if s == "" && required {
		return fmt.Errorf("empty %s", what)
	}
	if !utf8.ValidString(s) {
		return fmt.Errorf("%s %q is not valid UTF-8", what, s)
	}
	if i := strings.IndexFunc(s, unicode.IsControl); i >= 0 {
		return fmt.Errorf("%s %q has a control character at byte %d", what, s, i)
	}
	return nil
}

// validatePath requires a clean absolute path (or, if optional, nothing).
func validatePath(what, p string, optional bool) error {
	if p == "" && optional {
		return nil
	}
	if err := validateText(what, p, true); err != nil {
		return err
	}
	if !filepath.IsAbs(p) || filepath.Clean(p) != p {
		return fmt.Errorf("%s %q must be a clean absolute path", what, p)
	}
	return nil
}
