package devicemeta

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// TestSweepRemovesOnlyTheMetadataOfClaimsNotHeld: the metadata directories
// and metadata CDI specs of claims not held go; a held claim's stay, and so
// do the driver's own claim specs, another driver's metadata and anything
// else in the CDI directory.
func TestSweepRemovesOnlyTheMetadataOfClaimsNotHeld(t *testing.T) {
	dir := t.TempDir()
	f := Files{PluginDataDir: filepath.Join(dir, "plugin"), CDIDir: filepath.Join(dir, "cdi"), Driver: "gpu.tessera.dev"}
	files := map[string]bool{ // path -> kept
		"plugin/dra-device-metadata/ns_held/gpu/metadata.json":    true,
		"plugin/dra-device-metadata/ns_gone/gpu/metadata.json":    false,
		"plugin/dra-device-metadata/other_held/gpu/metadata.json": false, // same name, other namespace
		"plugin/checkpoint.json":                                  true,
		"cdi/gpu.tessera.dev_metadata_uid-held_gpu.json":          true,
		"cdi/gpu.tessera.dev_metadata_uid-gone_gpu.json":          false,
		"cdi/gpu.tessera.dev_metadata_uid-gone_second.json":       false,
		"cdi/gpu.tessera.dev-gpu_uid-gone.json":                   true, // the claim's own spec: not metadata
		"cdi/gpu.tessera.dev-domain_uid-gone.json":                true,
		"cdi/nic.example.com_metadata_uid-gone_nic.json":          true,
		"cdi/gpu.tessera.dev_metadata_uid-gone_gpu.json.tmp":      true,
	}
	for p := range files {
		p = filepath.Join(dir, p)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte("{}"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	n, err := f.Sweep([]Claim{{Namespace: "ns", Name: "held", UID: "uid-held"}})
	if err != nil {
		t.Fatal(err)
	}
	var wrong []string
	for p, kept := range files {
		_, err := os.Stat(filepath.Join(dir, p))
		if there := err == nil; there != kept {
			wrong = append(wrong, p)
		}
	}
	slices.Sort(wrong)
	if len(wrong) > 0 {
		t.Errorf("kept or removed wrongly: %v", wrong)
	}
	if n != 4 {
		t.Errorf("Sweep says it removed %d, want 4 (two directories, two specs)", n)
	}

	// Forget takes one claim's files; nothing there is no error.
	if err := f.Forget("ns", "held", "uid-held"); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"plugin/dra-device-metadata/ns_held", "cdi/gpu.tessera.dev_metadata_uid-held_gpu.json"} {
		if _, err := os.Stat(filepath.Join(dir, p)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s survived Forget: %v", p, err)
		}
	}
	if err := f.Forget("ns", "held", "uid-held"); err != nil {
		t.Errorf("Forget of a claim with no files: %v", err)
	}
}

// TestSweepOfANodeWithNoMetadataYet: neither directory there is no error.
func TestSweepOfANodeWithNoMetadataYet(t *testing.T) {
	dir := t.TempDir()
	f := Files{PluginDataDir: filepath.Join(dir, "plugin"), CDIDir: filepath.Join(dir, "cdi"), Driver: "gpu.tessera.dev"}
	if n, err := f.Sweep(nil); err != nil || n != 0 {
		t.Errorf("Sweep = %d, %v; want 0, nil", n, err)
	}
}
