package cdihook

import (
	"fmt"
	"os"
	"path/filepath"
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
	if err := writeAtomic(dest, data); err != nil {
		return fmt.Errorf("install the hook: %w", err)
	}
	if err := os.Chmod(dest, 0o755); err != nil {
		return fmt.Errorf("install the hook: %w", err)
	}
	return nil
}
