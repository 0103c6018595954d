// Package cachedir locates the cache test/k8sbin/build.sh fills (the
// cluster's binaries, the images' Debian packages): $TESSERA_CACHE, by
// default $HOME/.cache/tessera.
package cachedir

import (
	"os"
	"path/filepath"
)

// Root is the cache's root directory.
func Root() string {
	if root := os.Getenv("TESSERA_CACHE"); root != "" {
		return root
	}
	home, err := os.UserHomeDir()
	if err != nil {
		home = "/root"
	}
	return filepath.Join(home, ".cache", "tessera")
}
