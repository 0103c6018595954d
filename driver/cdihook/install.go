package cdihook

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/tessera-dev/tessera/driver/inroot"
)

// Install copies the running program to dest (the host path the CDI specs
// name), replacing the copy there atomically: a runtime starting the hook
// at that moment runs either the old one or the new one, whole. The
// DaemonSet's init container runs it, as the image has no shell or cp.
func Install(dest string) error {
	self, err := os.Executable()
	if err != nil {
		return fmt.Errorf("find this program: %w", err)
	}
	data, err := os.ReadFile(self)
	if err != nil {
		return fmt.Errorf("read this program: %w", err)
	}
	if err := os.MkdirAll(filepath.Dir(dest), 0o755); err != nil {
		return fmt.Errorf("install the hook: %w", err)
	}
	dir, err := inroot.OpenRoot(filepath.Dir(dest))
	if err != nil {
		return fmt.Errorf("install the hook: %w", err)
	}
	defer func() { _ = dir.Close() }()
	d, err := dir.OpenDir("/")
	if err != nil {
		return fmt.Errorf("install the hook: %w", err)
	}
	defer func() { _ = d.Close() }()
	// Executable as it is renamed in: a runtime never finds a copy it
	// cannot run.
	if err := d.WriteFile(filepath.Base(dest), data, 0o755); err != nil {
		return fmt.Errorf("install the hook: %w", err)
	}
	return nil
}
