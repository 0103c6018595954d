package devicemeta

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"k8s.io/apimachinery/pkg/types"
)

// metadataSubDir and the names below are where the kubelet plugin helper
// (k8s.io/dynamic-resource-allocation v0.37.2, kubeletplugin) keeps a
// claim's metadata, which it does not export:
//
//	<plugin data dir>/dra-device-metadata/<namespace>_<name>/<request>/metadata.json
//	<CDI dir>/<driver>_metadata_<claim UID>_<request>.json
//
// TestFilesFindWhatTheHelperWrote [driver/plugin] prepares a claim through
// the helper and fails if they move.
const metadataSubDir = "dra-device-metadata"

// Files are the metadata files of a node's claims.
type Files struct {
	// PluginDataDir is the plugin's data directory (the helper's
	// PluginDataDirectoryPath).
	PluginDataDir string
	// CDIDir is where the helper writes the CDI specs that mount them.
	CDIDir string
	// Driver is the driver's name.
	Driver string
}

// claimDir is a claim's metadata directory. Namespaces and names hold no
// "_" (DNS labels and subdomains), so it names one claim.
func (f Files) claimDir(namespace, name string) string {
	return filepath.Join(f.PluginDataDir, metadataSubDir, namespace+"_"+name)
}

// specPrefix starts every metadata CDI spec's file name of the driver.
func (f Files) specPrefix() string { return f.Driver + "_metadata_" }

// Forget removes a claim's metadata and the CDI specs that mount it: what
// the helper removes when the kubelet unprepares the claim, for a claim
// the plugin unprepares itself. Files already gone are no error.
func (f Files) Forget(namespace, name string, uid types.UID) error {
	if err := os.RemoveAll(f.claimDir(namespace, name)); err != nil {
		return fmt.Errorf("remove the device metadata of claim %s/%s: %w", namespace, name, err)
	}
	specs, err := filepath.Glob(filepath.Join(f.CDIDir, f.specPrefix()+string(uid)+"_*.json"))
	if err != nil {
		return fmt.Errorf("list the device metadata CDI specs of claim %s/%s: %w", namespace, name, err)
	}
	for _, s := range specs {
		if err := os.Remove(s); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("remove device metadata CDI spec %s: %w", s, err)
		}
	}
	return nil
}

// Claim names a claim the node holds.
type Claim struct {
	Namespace, Name string
	UID             types.UID
}

// Sweep removes the metadata and metadata CDI specs of every claim that is
// not among held, returning how many it removed. Run it only where no
// prepare can run meanwhile (before the plugin registers with the kubelet,
// and not beside another instance): a claim prepared after held was read
// would lose its files.
func (f Files) Sweep(held []Claim) (int, error) {
	names := map[string]bool{}
	uids := map[string]bool{}
	for _, c := range held {
		names[c.Namespace+"_"+c.Name] = true
		uids[string(c.UID)] = true
	}
	var errs []error
	removed := 0
	dirs, err := os.ReadDir(filepath.Join(f.PluginDataDir, metadataSubDir))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, fmt.Errorf("list device metadata: %w", err))
	}
	for _, d := range dirs {
		if names[d.Name()] {
			continue
		}
		if err := os.RemoveAll(filepath.Join(f.PluginDataDir, metadataSubDir, d.Name())); err != nil {
			errs = append(errs, fmt.Errorf("remove device metadata %s: %w", d.Name(), err))
			continue
		}
		removed++
	}
	specs, err := os.ReadDir(f.CDIDir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, fmt.Errorf("list CDI specs: %w", err))
	}
	for _, s := range specs {
		rest, ok := strings.CutPrefix(s.Name(), f.specPrefix())
		if !ok || !strings.HasSuffix(rest, ".json") {
			continue
		}
		uid, _, ok := strings.Cut(rest, "_")
		if !ok || uids[uid] {
			continue
		}
		if err := os.Remove(filepath.Join(f.CDIDir, s.Name())); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("remove device metadata CDI spec %s: %w", s.Name(), err))
			continue
		}
		removed++
	}
	return removed, errors.Join(errs...)
}
