// Package ociimage assembles container images as OCI archives without a
// container engine: layers from files and from Debian packages, an image
// config, and a tar in the OCI image layout that containerd imports (`ctr
// images import`). It builds Tessera's image (the Dockerfile's content), the
// pause image of the test cluster's real-runtime nodes and a busybox
// workload image (images.go).
package ociimage

import (
	"archive/tar"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// epoch is the modification time of every file this package generates, so
// that an image built twice from the same inputs has the same digest.
var epoch = time.Unix(0, 0).UTC()

// File is one entry of a layer. Exactly one of Data (a regular file), Link (a
// symlink's target) or Dir is meaningful.
type File struct {
	Path string // absolute path in the image
	Mode int64  // permission bits (and setuid/sticky)
	Data []byte
	Link string
	Dir  bool
	UID  int
	GID  int
}

// Tree is a layer's content keyed by path, so that later entries replace
// earlier ones (as a later package's file would on an installed system).
type Tree struct {
	entries map[string]entry
}

type entry struct {
	hdr  tar.Header
	data []byte
}

// NewTree returns an empty tree.
func NewTree() *Tree { return &Tree{entries: map[string]entry{}} }

// Add puts files into the tree, creating missing parent directories (0755).
func (t *Tree) Add(files ...File) {
	for _, f := range files {
		h := tar.Header{Name: clean(f.Path), Mode: f.Mode, Uid: f.UID, Gid: f.GID, ModTime: epoch, Format: tar.FormatPAX}
		switch {
		case f.Dir:
			h.Typeflag = tar.TypeDir
		case f.Link != "":
			h.Typeflag, h.Linkname = tar.TypeSymlink, f.Link
		default:
			h.Typeflag, h.Size = tar.TypeReg, int64(len(f.Data))
		}
		t.put(h, f.Data)
	}
}

// AddTar puts every entry of an uncompressed tar stream into the tree, with
// owners reset to root. keep, if set, says which paths to take.
func (t *Tree) AddTar(r io.Reader, keep func(path string) bool) error {
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return fmt.Errorf("read tar: %w", err)
		}
		name := clean(h.Name)
		if name == "" || (keep != nil && !keep("/"+name)) {
			continue
		}
		var data []byte
		switch h.Typeflag {
		case tar.TypeReg:
			if data, err = io.ReadAll(tr); err != nil {
				return fmt.Errorf("read %s from tar: %w", h.Name, err)
			}
		case tar.TypeDir, tar.TypeSymlink, tar.TypeLink:
		default:
			return fmt.Errorf("tar entry %s has type %q, which images built here do not hold", h.Name, h.Typeflag)
		}
		out := tar.Header{
			Name: name, Typeflag: h.Typeflag, Mode: h.Mode, Size: int64(len(data)),
			ModTime: h.ModTime.UTC(), Format: tar.FormatPAX,
		}
		switch h.Typeflag {
		case tar.TypeSymlink:
			out.Linkname = h.Linkname
		case tar.TypeLink:
			out.Linkname = clean(h.Linkname)
		}
		t.put(out, data)
	}
}

// Paths lists the tree's paths (absolute), sorted.
func (t *Tree) Paths() []string {
	out := make([]string, 0, len(t.entries))
	for name := range t.entries {
		out = append(out, "/"+strings.TrimSuffix(name, "/"))
	}
	sort.Strings(out)
	return out
}

func (t *Tree) put(h tar.Header, data []byte) {
	for dir := path.Dir(h.Name); dir != "." && dir != "/"; dir = path.Dir(dir) {
		if _, ok := t.entries[dir]; !ok {
			t.entries[dir] = entry{hdr: tar.Header{Name: dir, Typeflag: tar.TypeDir, Mode: 0o755, ModTime: epoch, Format: tar.FormatPAX}}
		}
	}
	if old, ok := t.entries[h.Name]; ok && old.hdr.Typeflag == tar.TypeDir && h.Typeflag == tar.TypeDir {
		return // the first package to ship a directory sets its mode
	}
	t.entries[h.Name] = entry{hdr: h, data: data}
}

// Layer writes the tree as an uncompressed tar, parents before children, and
// returns it as a layer (gzip-compressed in the image).
func (t *Tree) Layer() (v1.Layer, error) {
	names := make([]string, 0, len(t.entries))
	for name := range t.entries {
		names = append(names, name)
	}
	sort.Strings(names)
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, name := range names {
		e := t.entries[name]
		h := e.hdr
		if h.Typeflag == tar.TypeDir {
			h.Name += "/"
		}
		if err := tw.WriteHeader(&h); err != nil {
			return nil, fmt.Errorf("write layer entry %s: %w", name, err)
		}
		if _, err := tw.Write(e.data); err != nil {
			return nil, fmt.Errorf("write layer entry %s: %w", name, err)
		}
	}
	if err := tw.Close(); err != nil {
		return nil, fmt.Errorf("close layer: %w", err)
	}
	data := buf.Bytes()
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(data)), nil
	}, tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return nil, fmt.Errorf("make layer: %w", err)
	}
	return layer, nil
}

// clean turns an archive or image path into a tar entry name: relative,
// without "./" or a trailing slash.
func clean(p string) string {
	p = path.Clean("/" + p)
	return strings.TrimPrefix(p, "/")
}

// Config is what an image runs and how it is labelled.
type Config struct {
	Entrypoint []string
	Cmd        []string
	User       string
	Env        []string
	WorkingDir string
	Labels     map[string]string
}

// Build stacks the layers on an empty linux/amd64 OCI image with the config.
func Build(cfg Config, layers ...v1.Layer) (v1.Image, error) {
	img := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	img, err := mutate.AppendLayers(img, layers...)
	if err != nil {
		return nil, fmt.Errorf("append layers: %w", err)
	}
	file, err := img.ConfigFile()
	if err != nil {
		return nil, fmt.Errorf("read config: %w", err)
	}
	file = file.DeepCopy()
	file.Architecture, file.OS = "amd64", "linux"
	file.Created = v1.Time{Time: epoch}
	file.Config.Entrypoint = cfg.Entrypoint
	file.Config.Cmd = cfg.Cmd
	file.Config.User = cfg.User
	file.Config.Env = append([]string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}, cfg.Env...)
	file.Config.WorkingDir = cfg.WorkingDir
	file.Config.Labels = cfg.Labels
	img, err = mutate.ConfigFile(img, file)
	if err != nil {
		return nil, fmt.Errorf("set config: %w", err)
	}
	return img, nil
}

// WriteArchive writes images, keyed by their full names (e.g.
// "tessera.test/pause:1"), as one tar in the OCI image layout. containerd
// names each imported image by its io.containerd.image.name annotation.
func WriteArchive(file string, images map[string]v1.Image) error {
	names := make([]string, 0, len(images))
	for name := range images {
		names = append(names, name)
	}
	sort.Strings(names)
	tmp := file + ".tmp"
	f, err := os.Create(tmp)
	if err != nil {
		return fmt.Errorf("create archive: %w", err)
	}
	defer func() { _ = os.Remove(tmp) }()
	tw := tar.NewWriter(f)
	written := map[v1.Hash]bool{}
	blob := func(h v1.Hash, r io.Reader, size int64) error {
		if written[h] {
			return nil
		}
		written[h] = true
		name := path.Join("blobs", h.Algorithm, h.Hex)
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: size, ModTime: epoch, Typeflag: tar.TypeReg}); err != nil {
			return fmt.Errorf("write %s: %w", name, err)
		}
		if _, err := io.Copy(tw, r); err != nil {
			return fmt.Errorf("write %s: %w", name, err)
		}
		return nil
	}
	var index v1.IndexManifest
	index.SchemaVersion, index.MediaType = 2, types.OCIImageIndex
	for _, name := range names {
		desc, err := writeImage(images[name], blob)
		if err != nil {
			return fmt.Errorf("image %s: %w", name, err)
		}
		tag := name[strings.LastIndex(name, ":")+1:]
		desc.Annotations = map[string]string{"io.containerd.image.name": name, "org.opencontainers.image.ref.name": tag}
		index.Manifests = append(index.Manifests, desc)
	}
	for _, meta := range []struct {
		name string
		v    any
	}{{"oci-layout", map[string]string{"imageLayoutVersion": "1.0.0"}}, {"index.json", index}} {
		data, err := json.Marshal(meta.v)
		if err != nil {
			return fmt.Errorf("encode %s: %w", meta.name, err)
		}
		if err := tw.WriteHeader(&tar.Header{Name: meta.name, Mode: 0o644, Size: int64(len(data)), ModTime: epoch, Typeflag: tar.TypeReg}); err != nil {
			return fmt.Errorf("write %s: %w", meta.name, err)
		}
		if _, err := tw.Write(data); err != nil {
			return fmt.Errorf("write %s: %w", meta.name, err)
		}
	}
	if err := tw.Close(); err != nil {
		return fmt.Errorf("close archive: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("close archive: %w", err)
	}
	if err := os.MkdirAll(filepath.Dir(file), 0o755); err != nil {
		return fmt.Errorf("create archive dir: %w", err)
	}
	return os.Rename(tmp, file)
}

// writeImage writes an image's layers, config and manifest as blobs and
// returns the manifest's descriptor.
func writeImage(img v1.Image, blob func(v1.Hash, io.Reader, int64) error) (v1.Descriptor, error) {
	layers, err := img.Layers()
	if err != nil {
		return v1.Descriptor{}, fmt.Errorf("list layers: %w", err)
	}
	for _, l := range layers {
		h, err := l.Digest()
		if err != nil {
			return v1.Descriptor{}, fmt.Errorf("layer digest: %w", err)
		}
		size, err := l.Size()
		if err != nil {
			return v1.Descriptor{}, fmt.Errorf("layer size: %w", err)
		}
		rc, err := l.Compressed()
		if err != nil {
			return v1.Descriptor{}, fmt.Errorf("layer %s: %w", h, err)
		}
		err = blob(h, rc, size)
		_ = rc.Close()
		if err != nil {
			return v1.Descriptor{}, err
		}
	}
	for _, raw := range []func() ([]byte, error){img.RawConfigFile, img.RawManifest} {
		data, err := raw()
		if err != nil {
			return v1.Descriptor{}, fmt.Errorf("encode image: %w", err)
		}
		h, _, err := v1.SHA256(bytes.NewReader(data))
		if err != nil {
			return v1.Descriptor{}, err
		}
		if err := blob(h, bytes.NewReader(data), int64(len(data))); err != nil {
			return v1.Descriptor{}, err
		}
	}
	digest, err := img.Digest()
	if err != nil {
		return v1.Descriptor{}, fmt.Errorf("manifest digest: %w", err)
	}
	raw, err := img.RawManifest()
	if err != nil {
		return v1.Descriptor{}, fmt.Errorf("encode manifest: %w", err)
	}
	return v1.Descriptor{
		MediaType: types.OCIManifestSchema1,
		Digest:    digest,
		Size:      int64(len(raw)),
		Platform:  &v1.Platform{OS: "linux", Architecture: "amd64"},
	}, nil
}
