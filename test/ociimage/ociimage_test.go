package ociimage

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
)

// fakeDeb builds a Debian package named pkg holding files (path: content;
// content "->target" makes a symlink) with dpkg-deb, as Debian builds them.
func fakeDeb(t *testing.T, dir, pkg string, files map[string]string) {
	t.Helper()
	root := t.TempDir()
	control := fmt.Sprintf("Package: %s\nVersion: 1.0\nArchitecture: all\nMaintainer: test <test@example.com>\nDescription: test package\n", pkg)
	write := func(p, content string) {
		full := filepath.Join(root, p)
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			t.Fatal(err)
		}
		if target, ok := bytes.CutPrefix([]byte(content), []byte("->")); ok {
			if err := os.Symlink(string(target), full); err != nil {
				t.Fatal(err)
			}
			return
		}
		if err := os.WriteFile(full, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("DEBIAN/control", control)
	for p, content := range files {
		write(p, content)
	}
	out, err := exec.Command("dpkg-deb", "--root-owner-group", "--build", root, filepath.Join(dir, pkg+"_1.0_all.deb")).CombinedOutput()
	if err != nil {
		t.Fatalf("dpkg-deb --build: %v: %s", err, out)
	}
}

// archiveImage is one image read back from an archive.
type archiveImage struct {
	config v1.ConfigFile
	layers []map[string]*tar.Header // path -> header, per layer
	digest string
}

// readArchive reads an OCI archive written by WriteArchive, keyed by the
// names containerd would give the images.
func readArchive(t *testing.T, file string) map[string]archiveImage {
	t.Helper()
	f, err := os.Open(file)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }()
	files := map[string][]byte{}
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		files[h.Name], _ = io.ReadAll(tr)
	}
	if string(files["oci-layout"]) != `{"imageLayoutVersion":"1.0.0"}` {
		t.Fatalf("oci-layout = %q", files["oci-layout"])
	}
	blob := func(h v1.Hash) []byte {
		data, ok := files["blobs/sha256/"+h.Hex]
		if !ok {
			t.Fatalf("archive lacks blob %s", h)
		}
		return data
	}
	var index v1.IndexManifest
	if err := json.Unmarshal(files["index.json"], &index); err != nil {
		t.Fatal(err)
	}
	out := map[string]archiveImage{}
	for _, desc := range index.Manifests {
		var m v1.Manifest
		if err := json.Unmarshal(blob(desc.Digest), &m); err != nil {
			t.Fatal(err)
		}
		var img archiveImage
		img.digest = desc.Digest.String()
		if err := json.Unmarshal(blob(m.Config.Digest), &img.config); err != nil {
			t.Fatal(err)
		}
		for _, l := range m.Layers {
			zr, err := gzip.NewReader(bytes.NewReader(blob(l.Digest)))
			if err != nil {
				t.Fatal(err)
			}
			entries := map[string]*tar.Header{}
			lr := tar.NewReader(zr)
			for {
				h, err := lr.Next()
				if err == io.EOF {
					break
				}
				if err != nil {
					t.Fatal(err)
				}
				entries["/"+clean(h.Name)] = h
			}
			img.layers = append(img.layers, entries)
		}
		out[desc.Annotations["io.containerd.image.name"]] = img
	}
	return out
}

// TestTesseraImageHoldsBaseAndBinaries assembles Tessera's image from
// stand-in Debian packages and binaries and reads the archive back: the
// base layer holds the packages' files without their documentation (the
// licences stay), the users, the CA bundle and /tmp; the second layer the
// binaries under BinDir; the config the entrypoint, user and labels. A
// second build gives the same digest.
func TestTesseraImageHoldsBaseAndBinaries(t *testing.T) {
	debs := t.TempDir()
	for _, pkg := range basePackages {
		files := map[string]string{
			"usr/share/doc/" + pkg + "/copyright":    "licence",
			"usr/share/doc/" + pkg + "/changelog.gz": "changes",
			"usr/share/man/man1/" + pkg + ".1":       "manual",
		}
		switch pkg {
		case "libc6":
			files["lib/x86_64-linux-gnu/libc.so.6"] = "glibc"
			files["lib64/ld-linux-x86-64.so.2"] = "->/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
		case "ca-certificates":
			files["usr/share/ca-certificates/mozilla/A.crt"] = "cert A\n"
			files["usr/share/ca-certificates/mozilla/B.crt"] = "cert B\n"
		}
		fakeDeb(t, debs, pkg, files)
	}
	bins := t.TempDir()
	for _, c := range Commands {
		if err := os.WriteFile(filepath.Join(bins, c), []byte("binary "+c), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	build := func() map[string]archiveImage {
		img, err := Tessera(debs, bins)
		if err != nil {
			t.Fatal(err)
		}
		file := filepath.Join(t.TempDir(), "tessera.oci.tar")
		if err := WriteArchive(file, map[string]v1.Image{"example.test/tessera:dev": img}); err != nil {
			t.Fatal(err)
		}
		return readArchive(t, file)
	}
	images := build()
	img, ok := images["example.test/tessera:dev"]
	if !ok || len(images) != 1 {
		t.Fatalf("archive holds %v, want example.test/tessera:dev", slices.Collect(maps.Keys(images)))
	}
	if len(img.layers) != 2 {
		t.Fatalf("image has %d layers, want base and binaries", len(img.layers))
	}
	base, binLayer := img.layers[0], img.layers[1]
	for _, want := range []string{"/lib/x86_64-linux-gnu/libc.so.6", "/lib64/ld-linux-x86-64.so.2", "/usr/share/doc/libc6/copyright",
		"/etc/passwd", "/etc/group", "/etc/ssl/certs/ca-certificates.crt", "/tmp", "/home/nonroot"} {
		if base[want] == nil {
			t.Errorf("base layer lacks %s", want)
		}
	}
	for _, unwanted := range []string{"/usr/share/doc/libc6/changelog.gz", "/usr/share/man/man1/libc6.1", "/usr/share/man"} {
		if base[unwanted] != nil {
			t.Errorf("base layer holds %s", unwanted)
		}
	}
	if h := base["/tmp"]; h != nil && (h.Typeflag != tar.TypeDir || h.Mode != 0o1777) {
		t.Errorf("/tmp is type %c mode %o, want a directory with mode 1777", h.Typeflag, h.Mode)
	}
	if h := base["/home/nonroot"]; h != nil && h.Uid != 65532 {
		t.Errorf("/home/nonroot belongs to uid %d, want 65532", h.Uid)
	}
	var paths []string
	for p, h := range binLayer {
		if h.Typeflag == tar.TypeReg {
			paths = append(paths, p)
		}
	}
	slices.Sort(paths)
	var want []string
	for _, c := range Commands {
		want = append(want, BinDir+"/"+c)
	}
	slices.Sort(want)
	if !slices.Equal(paths, want) {
		t.Errorf("binary layer holds %v, want %v", paths, want)
	}
	cfg := img.config.Config
	if !slices.Equal(cfg.Entrypoint, Entrypoint) || cfg.User != User || !maps.Equal(cfg.Labels, Labels) {
		t.Errorf("config: entrypoint %q user %q labels %v, want %q %q %v", cfg.Entrypoint, cfg.User, cfg.Labels, Entrypoint, User, Labels)
	}
	if img.config.OS != "linux" || img.config.Architecture != "amd64" {
		t.Errorf("config platform %s/%s, want linux/amd64", img.config.OS, img.config.Architecture)
	}
	if again := build()["example.test/tessera:dev"]; again.digest != img.digest {
		t.Errorf("a second build has digest %s, the first %s: builds are not reproducible", again.digest, img.digest)
	}
}
