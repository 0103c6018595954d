package ociimage

import (
	"bytes"
	_ "embed"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/tessera-dev/tessera/test/cachedir"
)

// packagesFile lists the Debian packages the images are made of, one a line
// (debs.txt). test/k8sbin/build.sh downloads them with `apt-get download`
// into the deb cache (DebDir); building an image reads them from there and
// downloads nothing.
//
//go:embed debs.txt
var packagesFile string

// Packages returns the Debian packages the images need.
func Packages() []string {
	var out []string
	for _, line := range strings.Split(packagesFile, "\n") {
		if line = strings.TrimSpace(line); line != "" && !strings.HasPrefix(line, "#") {
			out = append(out, line)
		}
	}
	return out
}

// DebDir is where build.sh puts the Debian packages: $TESSERA_CACHE/debs,
// default $HOME/.cache/tessera/debs.
func DebDir() string { return filepath.Join(cachedir.Root(), "debs") }

// FindDeb returns the one downloaded .deb of the package in dir.
func FindDeb(dir, pkg string) (string, error) {
	matches, err := filepath.Glob(filepath.Join(dir, pkg+"_*.deb"))
	if err != nil {
		return "", err
	}
	switch len(matches) {
	case 0:
		return "", fmt.Errorf("the Debian package %s is not in %s: run `make cluster-bins` (test/k8sbin/build.sh downloads it)", pkg, dir)
	case 1:
		return matches[0], nil
	default:
		return "", fmt.Errorf("%s holds several versions of Debian package %s (%v): remove all but one", dir, pkg, matches)
	}
}

// AddDeb unpacks the files of a Debian package (its data archive, as
// `dpkg-deb --fsys-tarfile` reads it whatever its compression) into the
// tree; keep, if set, says which paths to take. Maintainer scripts do not
// run: what they would generate, the caller adds.
func (t *Tree) AddDeb(deb string, keep func(path string) bool) error {
	cmd := exec.Command("dpkg-deb", "--fsys-tarfile", deb)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return fmt.Errorf("unpack %s with dpkg-deb: %w: %s", deb, err, strings.TrimSpace(stderr.String()))
	}
	if err := t.AddTar(bytes.NewReader(out), keep); err != nil {
		return fmt.Errorf("unpack %s: %w", deb, err)
	}
	return nil
}
