package cdihook_test

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	oci "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/tessera-dev/tessera/driver/cdihook"
)

const version = "570.124.06"

// image builds a container's root file system whose loader looks in
// /lib/x86_64-linux-gnu (this host's glibc, copied in), with the driver's
// libcuda mounted in /usr/lib64, where that loader does not look, as on a
// Red Hat host: libcuda.so.<version> is a real ELF library (a copy of the
// host's libz, as the loader does not care what it holds), and its bundle,
// whose config.json names the root file system relative to it. It returns
// the bundle and the root.
func image(t *testing.T) (bundle, root string) {
	t.Helper()
	bundle = t.TempDir()
	root = filepath.Join(bundle, "rootfs")
	copyFile(t, "/lib/x86_64-linux-gnu/libc.so.6", filepath.Join(root, "lib/x86_64-linux-gnu/libc.so.6"))
	copyFile(t, "/lib64/ld-linux-x86-64.so.2", filepath.Join(root, "lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"))
	mkdir(t, filepath.Join(root, "lib64"))
	if err := os.Symlink("/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2", filepath.Join(root, "lib64/ld-linux-x86-64.so.2")); err != nil {
		t.Fatal(err)
	}
	copyFile(t, "/bin/true", filepath.Join(root, "bin/true"))
	copyFile(t, "/lib/x86_64-linux-gnu/libz.so.1", filepath.Join(root, "usr/lib64/libcuda.so."+version))
	mkdir(t, filepath.Join(root, "etc/ld.so.conf.d"))
	config, err := json.Marshal(oci.Spec{Version: oci.Version, Root: &oci.Root{Path: "rootfs"}})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(bundle, "config.json"), config, 0o644); err != nil {
		t.Fatal(err)
	}
	return bundle, root
}

func state(t *testing.T, bundle string) *bytes.Reader {
	t.Helper()
	s, err := json.Marshal(oci.State{Version: oci.Version, ID: "c1", Status: oci.StateCreating, Bundle: bundle})
	if err != nil {
		t.Fatal(err)
	}
	return bytes.NewReader(s)
}

var hookArgs = []string{"update-ldcache",
	"--link=/usr/lib64/libcuda.so.1=libcuda.so." + version,
	"--link=/usr/lib64/libcuda.so=libcuda.so.1",
	"--library=/usr/lib64/libcuda.so.1",
	"--library=/usr/lib64/libcuda.so",
}

// preload asks the container's own loader, chrooted into root, to load
// libcuda.so.1 by name before /bin/true, and returns what it printed.
func preload(t *testing.T, root string) string {
	t.Helper()
	cmd := exec.Command("/lib64/ld-linux-x86-64.so.2", "--list", "--preload", "libcuda.so.1", "/bin/true")
	cmd.SysProcAttr = &syscall.SysProcAttr{Chroot: root}
	cmd.Dir = "/"
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("the container's loader: %v\n%s", err, out)
	}
	return string(out)
}

// TestTheContainersLoaderFindsLibcuda: before the hook, the container's
// loader cannot find libcuda.so.1 (its directory is not one it searches);
// after it, the loader (run chrooted in the container's root) loads it
// through the cache, the links exist, the loader configuration lists
// /usr/lib64, and glibc's ldconfig reads the cache.
func TestTheContainersLoaderFindsLibcuda(t *testing.T) {
	bundle, root := image(t)
	if out := preload(t, root); !strings.Contains(out, "cannot be preloaded") {
		t.Fatalf("before the hook the loader found libcuda.so.1, the test proves nothing:\n%s", out)
	}
	if err := cdihook.Main(hookArgs, state(t, bundle)); err != nil {
		t.Fatal(err)
	}
	if out := preload(t, root); !strings.Contains(out, "libcuda.so.1 => /usr/lib64/libcuda.so.1") {
		t.Errorf("after the hook the loader does not load libcuda.so.1 from /usr/lib64:\n%s", out)
	}
	for link, want := range map[string]string{"usr/lib64/libcuda.so.1": "libcuda.so." + version, "usr/lib64/libcuda.so": "libcuda.so.1"} {
		if got, err := os.Readlink(filepath.Join(root, link)); err != nil || got != want {
			t.Errorf("/%s -> %q (%v), want %q", link, got, err, want)
		}
	}
	if conf, err := os.ReadFile(filepath.Join(root, cdihook.ConfFile)); err != nil || string(conf) != "/usr/lib64\n" {
		t.Errorf("%s: %q (%v), want /usr/lib64", cdihook.ConfFile, conf, err)
	}
	out, err := exec.Command("ldconfig", "-p", "-C", filepath.Join(root, "etc/ld.so.cache")).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "libcuda.so.1 (libc6,x86-64) => /usr/lib64/libcuda.so.1") {
		t.Errorf("ldconfig -p of the container's cache (%v):\n%s", err, out)
	}
	if got := readCache(t, filepath.Join(root, "etc/ld.so.cache")); got["libcuda.so.1"] != "/usr/lib64/libcuda.so.1" || got["libcuda.so"] != "/usr/lib64/libcuda.so" {
		t.Errorf("cache entries %v", got)
	}
}

// TestTheHookKeepsTheImagesCacheAndIsIdempotent: an image's own cache (this
// host's) keeps every entry, and a second run (a second claim's spec runs
// the hook again) changes nothing.
func TestTheHookKeepsTheImagesCacheAndIsIdempotent(t *testing.T) {
	bundle, root := image(t)
	copyFile(t, "/etc/ld.so.cache", filepath.Join(root, "etc/ld.so.cache"))
	before := readCache(t, filepath.Join(root, "etc/ld.so.cache"))
	if err := cdihook.Main(hookArgs, state(t, bundle)); err != nil {
		t.Fatal(err)
	}
	first, err := os.ReadFile(filepath.Join(root, "etc/ld.so.cache"))
	if err != nil {
		t.Fatal(err)
	}
	after := readCache(t, filepath.Join(root, "etc/ld.so.cache"))
	for k, v := range before {
		if after[k] != v {
			t.Errorf("entry %s: %q after the hook, %q before", k, after[k], v)
		}
	}
	if len(after) != len(before)+2 {
		t.Errorf("%d keys after the hook, want %d", len(after), len(before)+2)
	}
	if err := cdihook.Main(hookArgs, state(t, bundle)); err != nil {
		t.Fatal(err)
	}
	second, err := os.ReadFile(filepath.Join(root, "etc/ld.so.cache"))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(first, second) {
		t.Error("a second run changed the cache")
	}
	if out := preload(t, root); !strings.Contains(out, "libcuda.so.1 => /usr/lib64/libcuda.so.1") {
		t.Errorf("the loader does not load libcuda.so.1 from /usr/lib64:\n%s", out)
	}
}

// TestLinksInTheImageCannotLeadOut: an image whose /usr/lib64 is a link to
// an absolute path gets it resolved inside its root, never on the host.
func TestLinksInTheImageCannotLeadOut(t *testing.T) {
	bundle := t.TempDir()
	root := filepath.Join(bundle, "rootfs")
	outside := t.TempDir()
	mkdir(t, filepath.Join(root, "usr"))
	mkdir(t, filepath.Join(root, outside))
	// Inside the root, <outside> is an empty directory; on the host it is
	// another one the hook must not touch.
	if err := os.Symlink(outside, filepath.Join(root, "usr/lib64")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, outside, "libcuda.so."+version), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	mkdir(t, filepath.Join(root, "etc"))
	config, _ := json.Marshal(oci.Spec{Root: &oci.Root{Path: root}})
	if err := os.WriteFile(filepath.Join(bundle, "config.json"), config, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := cdihook.Main(hookArgs, state(t, bundle)); err != nil {
		t.Fatal(err)
	}
	if entries, _ := os.ReadDir(outside); len(entries) != 0 {
		t.Errorf("the hook wrote outside the container's root: %v", entries)
	}
	if _, err := os.Lstat(filepath.Join(root, outside, "libcuda.so.1")); err != nil {
		t.Errorf("the link was not made inside the root: %v", err)
	}
}

// TestAnImageWithoutEtcGetsTheLinksAlone: a scratch image has no loader
// cache to update; its container still starts, with the links.
func TestAnImageWithoutEtcGetsTheLinksAlone(t *testing.T) {
	bundle := t.TempDir()
	root := filepath.Join(bundle, "rootfs")
	mkdir(t, filepath.Join(root, "usr/lib64"))
	if err := os.WriteFile(filepath.Join(root, "usr/lib64/libcuda.so."+version), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	config, _ := json.Marshal(oci.Spec{Root: &oci.Root{Path: "rootfs"}})
	if err := os.WriteFile(filepath.Join(bundle, "config.json"), config, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := cdihook.Main(hookArgs, state(t, bundle)); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(filepath.Join(root, "usr/lib64/libcuda.so.1")); err != nil {
		t.Errorf("no link: %v", err)
	}
	if _, err := os.Lstat(filepath.Join(root, "etc")); err == nil {
		t.Error("the hook made /etc in an image that has none")
	}
}

func TestBadInvocationsFail(t *testing.T) {
	bundle, _ := image(t)
	for name, args := range map[string][]string{
		"no command":           nil,
		"unknown command":      {"frobnicate"},
		"relative link":        {"update-ldcache", "--link=usr/lib64/libcuda.so=libcuda.so.1"},
		"missing library":      {"update-ldcache", "--library=/usr/lib64/libnvidia-ml.so.1"},
		"install with no dest": {"install"},
	} {
		if err := cdihook.Main(args, state(t, bundle)); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
	if err := cdihook.Main([]string{"update-ldcache"}, strings.NewReader("not json")); err == nil {
		t.Error("bad state: no error")
	}
}

// readCache lists a loader cache's entries (key -> path). It is written for
// the test from glibc's description of the format, apart from package
// ldcache, which it checks.
func readCache(t *testing.T, path string) map[string]string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	const magic = "glibc-ld.so.cache1.1"
	if !bytes.HasPrefix(data, []byte(magic)) {
		t.Fatalf("%s: no %s header", path, magic)
	}
	n := int(binary.LittleEndian.Uint32(data[20:24]))
	cstring := func(off uint32) string {
		end := bytes.IndexByte(data[off:], 0)
		return string(data[off : int(off)+end])
	}
	out := map[string]string{}
	for i := 0; i < n; i++ {
		e := data[48+24*i : 48+24*(i+1)]
		k := cstring(binary.LittleEndian.Uint32(e[4:8]))
		if _, seen := out[k]; !seen { // the loader takes the first
			out[k] = cstring(binary.LittleEndian.Uint32(e[8:12]))
		}
	}
	return out
}

func mkdir(t *testing.T, p string) {
	t.Helper()
	if err := os.MkdirAll(p, 0o755); err != nil {
		t.Fatal(err)
	}
}

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	data, err := os.ReadFile(from)
	if err != nil {
		t.Fatal(err)
	}
	mkdir(t, filepath.Dir(to))
	if err := os.WriteFile(to, data, 0o755); err != nil {
		t.Fatal(err)
	}
}
