package ociimage

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"sort"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"
)

// Tessera's image, as the Dockerfile builds it. dockerfile_test.go parses
// the Dockerfile and fails when these differ from it.
const (
	// DebianRelease is the Debian release of the base: the Dockerfile's
	// gcr.io/distroless/base-debian12.
	DebianRelease = "12"
	// BinDir is where the binaries go.
	BinDir = "/usr/local/bin"
	// User is the image's user: distroless/base's default, root.
	User = ""
)

// Commands are the binaries of Tessera's image, each built from ./cmd/<name>.
var Commands = []string{"tessera", "tessera-kubelet-plugin", "tessera-controller", "tessera-webhook", "tessera-cdi-hook", "tessera-fake-imex"}

// Entrypoint is the image's entrypoint.
var Entrypoint = []string{"/usr/local/bin/tessera-kubelet-plugin"}

// Labels are the image's labels.
var Labels = map[string]string{
	"org.opencontainers.image.source":      "https://github.com/tessera-dev/tessera",
	"org.opencontainers.image.description": "Tessera: a Kubernetes DRA driver for NVIDIA GPUs",
}

// GoBuildEnv and GoBuildArgs are how the binaries are built (after `go
// build`, before the packages): cgo for go-nvml, whose headers use
// deprecated declarations on purpose; grpcnotrace (see the Makefile).
var (
	GoBuildEnv  = []string{"CGO_ENABLED=1", "CGO_CFLAGS=-Wno-deprecated-declarations"}
	GoBuildArgs = []string{"-tags=grpcnotrace", "-trimpath", "-ldflags=-s -w"}
)

// basePackages are the Debian packages of distroless/base-debian12.
var basePackages = []string{"base-files", "netbase", "tzdata", "ca-certificates", "libc6", "libssl3"}

// BuildBinaries builds Tessera's commands into outDir as the Dockerfile
// does. It runs in the module (or any directory inside it).
func BuildBinaries(ctx context.Context, moduleDir, outDir string) error {
	args := append([]string{"build"}, GoBuildArgs...)
	args = append(args, "-o", outDir+"/")
	for _, c := range Commands {
		args = append(args, "./cmd/"+c)
	}
	return goBuild(ctx, moduleDir, GoBuildEnv, args)
}

// Tessera assembles Tessera's image: a base layer of Debian packages (the
// files distroless/base-debian12 holds) and a layer with the binaries found
// in binDir.
func Tessera(debDir, binDir string) (v1.Image, error) {
	base, err := baseTree(debDir)
	if err != nil {
		return nil, err
	}
	baseLayer, err := base.Layer()
	if err != nil {
		return nil, err
	}
	bins := NewTree()
	for _, c := range Commands {
		data, err := os.ReadFile(filepath.Join(binDir, c))
		if err != nil {
			return nil, fmt.Errorf("read Tessera binary: %w", err)
		}
		bins.Add(File{Path: path.Join(BinDir, c), Mode: 0o755, Data: data})
	}
	binLayer, err := bins.Layer()
	if err != nil {
		return nil, err
	}
	return Build(Config{Entrypoint: Entrypoint, User: User, Labels: Labels}, baseLayer, binLayer)
}

// baseTree unpacks the base packages and adds what their maintainer scripts
// and distroless would: users, the CA bundle, /tmp.
func baseTree(debDir string) (*Tree, error) {
	t := NewTree()
	for _, pkg := range basePackages {
		deb, err := FindDeb(debDir, pkg)
		if err != nil {
			return nil, err
		}
		if err := t.AddDeb(deb, keepInBase); err != nil {
			return nil, err
		}
	}
	var bundle bytes.Buffer
	certs := 0
	for _, p := range t.Paths() {
		if strings.HasPrefix(p, "/usr/share/ca-certificates/") && strings.HasSuffix(p, ".crt") {
			bundle.Write(t.entries[clean(p)].data)
			certs++
		}
	}
	if certs == 0 {
		return nil, fmt.Errorf("ca-certificates holds no certificates under /usr/share/ca-certificates")
	}
	t.Add(
		File{Path: "/etc/ssl/certs/ca-certificates.crt", Mode: 0o644, Data: bundle.Bytes()},
		File{Path: "/etc/passwd", Mode: 0o644, Data: []byte(
			"root:x:0:0:root:/root:/sbin/nologin\n" +
				"nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\n" +
				"nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n")},
		File{Path: "/etc/group", Mode: 0o644, Data: []byte("root:x:0:\nnobody:x:65534:\nnonroot:x:65532:\n")},
		File{Path: "/etc/nsswitch.conf", Mode: 0o644, Data: []byte("passwd: files\ngroup: files\nhosts: files dns\n")},
		File{Path: "/root", Mode: 0o700, Dir: true},
		File{Path: "/home/nonroot", Mode: 0o700, Dir: true, UID: 65532, GID: 65532},
		File{Path: "/tmp", Mode: 0o1777, Dir: true},
		File{Path: "/etc/ld.so.conf", Mode: 0o644, Data: []byte("include /etc/ld.so.conf.d/*.conf\n")},
		File{Path: "/etc/ld.so.conf.d", Mode: 0o755, Dir: true},
		File{Path: "/usr", Mode: 0o755, Dir: true},
		File{Path: "/usr/lib64", Mode: 0o755, Dir: true},
	)
	return t, nil
}

// keepInBase leaves documentation out of the base, except the licences.
func keepInBase(p string) bool {
	for _, dir := range []string{"/usr/share/man", "/usr/share/info", "/usr/share/lintian"} {
		if p == dir || strings.HasPrefix(p, dir+"/") {
			return false
		}
	}
	if rest, ok := strings.CutPrefix(p, "/usr/share/doc/"); ok {
		parts := strings.Split(rest, "/")
		return len(parts) == 1 || (len(parts) == 2 && parts[1] == "copyright")
	}
	return true
}

// PauseName and BusyboxName are the names the real-runtime nodes import the
// pause and workload images under (.test is a reserved domain: nothing is
// ever pulled).
const (
	PauseName   = "tessera.test/pause:1"
	BusyboxName = "tessera.test/busybox:1"
)

// BuildPause builds test/cmd/pause statically into out.
func BuildPause(ctx context.Context, moduleDir, out string) error {
	return goBuild(ctx, moduleDir, []string{"CGO_ENABLED=0"},
		[]string{"build", "-trimpath", "-ldflags=-s -w", "-o", out, "github.com/tessera-dev/tessera/test/cmd/pause"})
}

// Pause assembles the pause image from the binary BuildPause built. It runs
// as nobody, as registry.k8s.io/pause does.
func Pause(binary string) (v1.Image, error) {
	data, err := os.ReadFile(binary)
	if err != nil {
		return nil, fmt.Errorf("read pause binary: %w", err)
	}
	t := NewTree()
	t.Add(File{Path: "/pause", Mode: 0o755, Data: data})
	layer, err := t.Layer()
	if err != nil {
		return nil, err
	}
	return Build(Config{Entrypoint: []string{"/pause"}, User: "65535:65535"}, layer)
}

// Busybox assembles a workload image from Debian's busybox-static: the
// binary, a link for each of its applets, root and nobody, /tmp, and the
// loader configuration of a /usr/lib64 distribution (Fedora's layout: an
// /etc/ld.so.conf including /etc/ld.so.conf.d, and /usr/lib64), so that the
// tests see what tessera-cdi-hook does for an image whose loader does not
// look where a Debian host keeps the driver's libraries.
func Busybox(debDir string) (v1.Image, error) {
	deb, err := FindDeb(debDir, "busybox-static")
	if err != nil {
		return nil, err
	}
	t := NewTree()
	if err := t.AddDeb(deb, func(p string) bool { return p == "/bin" || p == "/bin/busybox" }); err != nil {
		return nil, err
	}
	e, ok := t.entries["bin/busybox"]
	if !ok {
		return nil, fmt.Errorf("%s holds no /bin/busybox", deb)
	}
	applets, err := busyboxApplets(e.data)
	if err != nil {
		return nil, err
	}
	for _, a := range applets {
		if a != "/bin/busybox" {
			t.Add(File{Path: a, Link: "/bin/busybox"})
		}
	}
	t.Add(
		File{Path: "/etc/passwd", Mode: 0o644, Data: []byte("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n")},
		File{Path: "/etc/group", Mode: 0o644, Data: []byte("root:x:0:\nnobody:x:65534:\n")},
		File{Path: "/root", Mode: 0o700, Dir: true},
		File{Path: "/tmp", Mode: 0o1777, Dir: true},
		File{Path: "/etc/ld.so.conf", Mode: 0o644, Data: []byte("include /etc/ld.so.conf.d/*.conf\n")},
		File{Path: "/etc/ld.so.conf.d", Mode: 0o755, Dir: true},
		File{Path: "/usr", Mode: 0o755, Dir: true},
		File{Path: "/usr/lib64", Mode: 0o755, Dir: true},
	)
	layer, err := t.Layer()
	if err != nil {
		return nil, err
	}
	return Build(Config{Cmd: []string{"sh"}}, layer)
}

// busyboxApplets asks the (static) busybox binary where its applets live.
func busyboxApplets(binary []byte) ([]string, error) {
	dir, err := os.MkdirTemp("", "busybox-")
	if err != nil {
		return nil, err
	}
	defer func() { _ = os.RemoveAll(dir) }()
	bin := filepath.Join(dir, "busybox")
	if err := os.WriteFile(bin, binary, 0o755); err != nil {
		return nil, err
	}
	out, err := exec.Command(bin, "--list-full").Output()
	if err != nil {
		return nil, fmt.Errorf("list busybox applets: %w", err)
	}
	var applets []string
	for _, line := range strings.Fields(string(out)) {
		applets = append(applets, "/"+line)
	}
	if len(applets) == 0 {
		return nil, fmt.Errorf("busybox --list-full listed no applets")
	}
	sort.Strings(applets)
	return applets, nil
}

func goBuild(ctx context.Context, dir string, env, args []string) error {
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("go %s: %w\n%s", strings.Join(args, " "), err, out.String())
	}
	return nil
}

// NodeImages builds the images a real-runtime node of the test cluster
// imports (pause and busybox), keyed by name; workDir holds the pause
// binary.
func NodeImages(ctx context.Context, moduleDir, workDir, debDir string) (map[string]v1.Image, error) {
	if err := os.MkdirAll(workDir, 0o755); err != nil {
		return nil, err
	}
	pauseBin := filepath.Join(workDir, "pause")
	if err := BuildPause(ctx, moduleDir, pauseBin); err != nil {
		return nil, err
	}
	pause, err := Pause(pauseBin)
	if err != nil {
		return nil, err
	}
	busybox, err := Busybox(debDir)
	if err != nil {
		return nil, err
	}
	return map[string]v1.Image{PauseName: pause, BusyboxName: busybox}, nil
}

// BuildAll builds Tessera's image (named tesseraName) and the node images,
// keyed by archive file name: tessera.oci.tar and node-images.oci.tar.
func BuildAll(ctx context.Context, moduleDir, workDir, debDir, tesseraName string) (map[string]map[string]v1.Image, error) {
	binDir := filepath.Join(workDir, "bin")
	if err := BuildBinaries(ctx, moduleDir, binDir); err != nil {
		return nil, err
	}
	tessera, err := Tessera(debDir, binDir)
	if err != nil {
		return nil, err
	}
	node, err := NodeImages(ctx, moduleDir, workDir, debDir)
	if err != nil {
		return nil, err
	}
	return map[string]map[string]v1.Image{
		"tessera.oci.tar":     {tesseraName: tessera},
		"node-images.oci.tar": node,
	}, nil
}
