package cdi

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"
	"tags.cncf.io/container-device-interface/pkg/parser"
	cdispec "tags.cncf.io/container-device-interface/specs-go"
)

// fileMode of every spec file: readable by the runtime, never world-writable.
const fileMode = 0o644

// Store writes, removes and lists the spec files of claims in one directory
// (usually /var/run/cdi, which the runtime watches).
//
// File contract: one file per claim and CDI class, named
// "gpu.tessera.dev-<class>_<claimUID>.json" (the CDI library's transient spec
// name; class "gpu" for NewStore). Stores of different classes share a
// directory without seeing each other's files. The CDI library itself
// validates and writes each file, and files appear and change only by
// rename, so the runtime never sees a partial or invalid spec. Temporary
// files (the library's "spec.*.tmp", or "."-prefixed ones of earlier
// versions) do not end in ".json", so CDI scanners skip them; a crash
// mid-write can leave one behind, and it is harmless. A Store holds no state
// besides its dir: calls for different claims may run concurrently.
type Store struct {
	dir   string
	class string
	// writer is the CDI library's cache of dir, used only to validate and
	// write specs: it never refreshes (no watcher, no rescans).
	writer *cdiapi.Cache
}

// NewStore returns a Store of class Class for dir, creating dir (mode 0755)
// if needed.
func NewStore(dir string) (*Store, error) {
	return NewStoreOfClass(dir, Class)
}

// NewStoreOfClass returns a Store whose specs and devices are of the given
// CDI class (vendor Vendor), e.g. "domain" for gang domain channels.
func NewStoreOfClass(dir, class string) (*Store, error) {
	if err := parser.ValidateClassName(class); err != nil {
		return nil, fmt.Errorf("CDI class %q: %w", class, err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("create CDI spec dir: %w", err)
	}
	// NewCache's error is always nil (kept for API compatibility).
	writer, _ := cdiapi.NewCache(cdiapi.WithSpecDirs(dir), cdiapi.WithAutoRefresh(false))
	return &Store{dir: dir, class: class, writer: writer}, nil
}

// Path returns the path of the spec file of a claim.
func (s *Store) Path(claimUID string) string {
	return filepath.Join(s.dir, s.fileName(claimUID))
}

// filePrefix starts the name of every spec file of the store's class.
func (s *Store) filePrefix() string {
	return cdiapi.GenerateTransientSpecName(Vendor, s.class, "")
}

func (s *Store) fileName(claimUID string) string {
	return cdiapi.GenerateTransientSpecName(Vendor, s.class, claimUID) + ".json"
}

// kind is the CDI kind of the store's specs.
func (s *Store) kind() string { return Vendor + "/" + s.class }

// Write validates spec, writes its CDI spec file atomically (replacing any
// earlier one of the same claim) and returns the fully-qualified CDI device ID
// of each device, keyed by the device's Name. A spec the CDI library would
// reject never reaches the file name the runtime reads.
func (s *Store) Write(spec ClaimSpec) (map[string]string, error) {
	raw, err := spec.toCDI(s.kind())
	if err != nil {
		return nil, fmt.Errorf("%s: build CDI spec: %w", spec, err)
	}
	if err := s.writeFile(raw, spec.ClaimUID); err != nil {
		return nil, fmt.Errorf("%s: %w", spec, err)
	}
	ids := make(map[string]string, len(spec.Devices))
	for _, d := range spec.Devices {
		ids[d.Name] = parser.QualifiedName(Vendor, s.class, cdiDeviceName(spec.ClaimUID, d.Name))
	}
	return ids, nil
}

// writeFile has the CDI library validate raw in memory and write it as the
// claim's spec file: a temporary file in the same dir, renamed over the
// name. A spec the library would reject never reaches the file name the
// runtime reads. Nothing is fsynced: the runtime reads the spec through the
// page cache, and a spec only matters within the boot that wrote it (the CDI
// directory is usually tmpfs; after a reboot the plugin removes the specs of
// the earlier boot). Every prepare waits for this write, so fsyncs, like the
// YAML parse of reading the file back to validate it, were pure latency.
func (s *Store) writeFile(raw *cdispec.Spec, claimUID string) error {
	name := s.fileName(claimUID)
	if err := s.writer.WriteSpec(raw, name); err != nil {
		return fmt.Errorf("CDI library rejects or cannot write the spec %s: %w", filepath.Join(s.dir, name), err)
	}
	// The library writes owner-only files; the runtime may read as another
	// user.
	if err := os.Chmod(filepath.Join(s.dir, name), fileMode); err != nil {
		return fmt.Errorf("chmod CDI spec: %w", err)
	}
	return nil
}

// Remove deletes the spec file of a claim. A missing file is success, so
// Remove can be retried.
func (s *Store) Remove(claimUID string) error {
	if err := validateClaimUID(claimUID); err != nil {
		return fmt.Errorf("remove CDI spec: %w", err)
	}
	path := s.Path(claimUID)
	err := os.Remove(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("claim %s: remove CDI spec: %w", claimUID, err)
	}
	return nil
}

// List reads back every spec file of ours in the directory, sorted by claim
// UID, e.g. to rebuild a lost checkpoint. Files of others (any name without
// our prefix) are ignored. Files of ours that cannot be read, fail CDI
// validation, or lack our annotations do not stop List: the specs that could
// be read are returned together with an error that names each bad file.
func (s *Store) List() ([]ClaimSpec, error) {
	entries, err := os.ReadDir(s.dir)
	if err != nil {
		return nil, fmt.Errorf("list CDI specs: %w", err)
	}
	var (
		specs []ClaimSpec
		errs  []error
	)
	for _, e := range entries { // sorted by name, so by claim UID
		name := e.Name()
		if e.IsDir() || !strings.HasPrefix(name, s.filePrefix()) || !strings.HasSuffix(name, ".json") {
			continue
		}
		path := filepath.Join(s.dir, name)
		spec, err := s.readSpec(path)
		if err != nil {
			errs = append(errs, fmt.Errorf("CDI spec %s: %w; remove the file if its claim is gone", path, err))
			continue
		}
		specs = append(specs, spec)
	}
	return specs, errors.Join(errs...)
}

func (s *Store) readSpec(path string) (ClaimSpec, error) {
	spec, err := cdiapi.ReadSpec(path, 0)
	if err != nil {
		return ClaimSpec{}, err
	}
	c, err := fromCDI(spec.Spec, s.kind())
	if err != nil {
		return ClaimSpec{}, err
	}
	if err := validateClaimUID(c.ClaimUID); err != nil {
		return ClaimSpec{}, err
	}
	if s.fileName(c.ClaimUID) != filepath.Base(path) {
		return ClaimSpec{}, fmt.Errorf("claim UID %q does not match the file name", c.ClaimUID)
	}
	return c, nil
}
