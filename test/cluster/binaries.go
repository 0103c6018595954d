package cluster

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/tessera-dev/tessera/test/cachedir"
)

// The versions test/k8sbin pins; binaries_test.go checks they match its
// go.mod files.
const (
	KubernetesVersion = "v1.37.2"
	EtcdVersion       = "v3.7.3"
	ContainerdVersion = "v2.4.2"
	CNIPluginsVersion = "v1.10.0"
)

// Binaries are the paths of the executables a cluster runs.
type Binaries struct {
	Etcd, APIServer, Scheduler, ControllerManager, Kubelet string
}

// CacheDir is where test/k8sbin/build.sh puts binaries:
// $TESSERA_CACHE/bin, default $HOME/.cache/tessera/bin.
func CacheDir() string { return filepath.Join(cachedir.Root(), "bin") }

// FindBinaries returns the cached binaries, or an error saying which are
// missing and how to build them.
func FindBinaries() (Binaries, error) {
	k8s := filepath.Join(CacheDir(), "k8s-"+KubernetesVersion)
	etcd := filepath.Join(CacheDir(), "etcd-"+EtcdVersion)
	b := Binaries{
		Etcd:              filepath.Join(etcd, "etcd"),
		APIServer:         filepath.Join(k8s, "kube-apiserver"),
		Scheduler:         filepath.Join(k8s, "kube-scheduler"),
		ControllerManager: filepath.Join(k8s, "kube-controller-manager"),
		Kubelet:           filepath.Join(k8s, "kubelet"),
	}
	var missing []string
	for _, dir := range []string{k8s, etcd} {
		if _, err := os.Stat(filepath.Join(dir, ".stamp")); err != nil {
			missing = append(missing, filepath.Join(dir, ".stamp"))
		}
	}
	for _, path := range []string{b.Etcd, b.APIServer, b.Scheduler, b.ControllerManager, b.Kubelet} {
		if _, err := os.Stat(path); err != nil {
			missing = append(missing, path)
		}
	}
	if len(missing) > 0 {
		return b, fmt.Errorf("cluster binaries missing (%s): run `make cluster-bins`", strings.Join(missing, ", "))
	}
	return b, nil
}

// RuntimeBinaries are the executables a real-runtime node runs besides the
// kubelet: containerd and its client from the cache, the CNI plugins' dir,
// and Debian's runc.
type RuntimeBinaries struct {
	Containerd, Ctr, Runc, CNIDir string
}

// FindRuntimeBinaries returns the real-runtime node's binaries, or an error
// saying which are missing and how to get them.
func FindRuntimeBinaries() (RuntimeBinaries, error) {
	containerd := filepath.Join(CacheDir(), "containerd-"+ContainerdVersion)
	cni := filepath.Join(CacheDir(), "cni-"+CNIPluginsVersion)
	b := RuntimeBinaries{
		Containerd: filepath.Join(containerd, "containerd"),
		Ctr:        filepath.Join(containerd, "ctr"),
		CNIDir:     cni,
	}
	var missing []string
	for _, path := range []string{
		filepath.Join(containerd, ".stamp"), b.Containerd, b.Ctr, filepath.Join(containerd, "containerd-shim-runc-v2"),
		filepath.Join(cni, ".stamp"), filepath.Join(cni, "bridge"), filepath.Join(cni, "host-local"), filepath.Join(cni, "loopback"),
	} {
		if _, err := os.Stat(path); err != nil {
			missing = append(missing, path)
		}
	}
	runc, err := exec.LookPath("runc")
	if err != nil {
		missing = append(missing, "runc in PATH (Debian's runc package)")
	}
	b.Runc = runc
	for _, tool := range []string{"nsenter", "ip", "dpkg-deb"} {
		if _, err := exec.LookPath(tool); err != nil {
			missing = append(missing, tool+" in PATH")
		}
	}
	if len(missing) > 0 {
		return b, fmt.Errorf("real-runtime node prerequisites missing (%s): run `make cluster-bins`", strings.Join(missing, ", "))
	}
	return b, nil
}

// CheckPrerequisites returns an error naming everything this machine lacks
// to run a cluster: root, mount namespaces through unshare, a cgroup file
// system, and the cached binaries.
func CheckPrerequisites() error {
	var errs []error
	if os.Geteuid() != 0 {
		errs = append(errs, fmt.Errorf("must run as root (euid is %d): the kubelet mounts and manages cgroups", os.Geteuid()))
	}
	for _, tool := range []string{"unshare", "mount", "sh"} {
		if _, err := exec.LookPath(tool); err != nil {
			errs = append(errs, fmt.Errorf("%s not found in PATH (util-linux): %w", tool, err))
		}
	}
	if len(errs) == 0 {
		out, err := exec.Command("unshare", "-m", "--propagation", "private", "true").CombinedOutput()
		if err != nil {
			errs = append(errs, fmt.Errorf("cannot create a mount namespace (`unshare -m --propagation private true`: %v: %s)",
				err, strings.TrimSpace(string(out))))
		}
	}
	if err := checkCgroupFS(); err != nil {
		errs = append(errs, err)
	}
	if _, err := FindBinaries(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

func checkCgroupFS() error {
	mounts, err := os.ReadFile("/proc/self/mounts")
	if err != nil {
		return fmt.Errorf("read /proc/self/mounts to find the cgroup file system: %w", err)
	}
	for _, line := range strings.Split(string(mounts), "\n") {
		fields := strings.Fields(line)
		if len(fields) >= 3 && strings.HasPrefix(fields[1], "/sys/fs/cgroup") &&
			(fields[2] == "cgroup" || fields[2] == "cgroup2") {
			return nil
		}
	}
	return errors.New("no cgroup or cgroup2 file system mounted under /sys/fs/cgroup (the kubelet needs one)")
}
