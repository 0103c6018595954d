package fakenode_test

import (
	"os"
	"path"
	"path/filepath"
	"slices"
	"testing"

	"github.com/tessera-dev/tessera/driver/fakenode"
	"github.com/tessera-dev/tessera/test/ociimage"
)

// TestInstallDriverLinksNvidiaIMEXToTheStandIn: a fake driver's
// usr/bin/nvidia-imex is an absolute link to a binary of Tessera's image
// (the IMEX daemon pod resolves it there), nvidia-imex-ctl fails like the
// other fake tools, and installing again over a tree, even one whose
// nvidia-imex is a regular file, leaves the same.
func TestInstallDriverLinksNvidiaIMEXToTheStandIn(t *testing.T) {
	if dir, name := path.Split(fakenode.IMEXStandIn); path.Clean(dir) != ociimage.BinDir || !slices.Contains(ociimage.Commands, name) {
		t.Errorf("IMEXStandIn is %s, want a command of Tessera's image (%v) in %s", fakenode.IMEXStandIn, ociimage.Commands, ociimage.BinDir)
	}
	root := t.TempDir()
	bin := filepath.Join(root, "usr", "bin")
	if err := os.MkdirAll(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(bin, "nvidia-imex"), []byte("an older install\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		if err := fakenode.InstallDriver(root, "usr/lib/x86_64-linux-gnu", "570.124.06"); err != nil {
			t.Fatalf("install %d: %v", i+1, err)
		}
		if target, err := os.Readlink(filepath.Join(bin, "nvidia-imex")); err != nil || target != fakenode.IMEXStandIn {
			t.Errorf("install %d: usr/bin/nvidia-imex links to %q (%v), want %s", i+1, target, err, fakenode.IMEXStandIn)
		}
		ctl := filepath.Join(bin, "nvidia-imex-ctl")
		data, err := os.ReadFile(ctl)
		if err != nil {
			t.Fatal(err)
		}
		fi, err := os.Lstat(ctl)
		if err != nil {
			t.Fatal(err)
		}
		if string(data) != "#!/bin/false\n" || !fi.Mode().IsRegular() || fi.Mode().Perm() != 0o755 {
			t.Errorf("install %d: usr/bin/nvidia-imex-ctl is %v %q, want an executable #!/bin/false", i+1, fi.Mode(), data)
		}
	}
}
