package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	"k8s.io/klog/v2"

	"github.com/tessera-dev/tessera/test/ociimage"
)

// A real-runtime node (RealContainerd) runs containerd, runc and the CNI
// bridge plugin. containerd and the kubelet share one mount namespace and
// one PID namespace, which a holder process (the namespace's init) keeps:
//
//   - the kubelet mounts pod volumes (projected tokens, emptyDirs) and reads
//     container logs below /var/log; containerd must see both, so they share
//     the namespace's mounts;
//   - /var/lib, /var/log and /run are node dirs there, so nothing containerd,
//     its shims, runc or the CNI plugins write by default lands on the host;
//     /proc/sys is read-only, so neither the kubelet nor a CNI plugin changes
//     a host setting (the bridge plugin ignores failing sysctl writes);
//   - when the holder dies (Stop, or the test process dying: Pdeathsig)
//     the kernel kills every process of the PID namespace: shims and
//     containers included, which otherwise outlive containerd.
//
// The network namespace is the host's, as on a real node: hostNetwork pods
// reach the API server on 127.0.0.1, and have the node's own address
// (Node.IP, on the pod bridge) as their hostIP and podIP. Other pods join
// the cluster's pod network (podnetwork.go), with addresses from the node's
// part of it.
type realRuntime struct {
	node   *Node
	dir    string // <node dir>/containerd
	bins   RuntimeBinaries
	index  int // among the cluster's real-runtime nodes: its part of the pod network
	holder *process
	daemon *process
}

// ContainerdSocket is the CRI endpoint of a real-runtime node's containerd.
func (r *realRuntime) socket() string { return filepath.Join(r.dir, "containerd.sock") }

// ContainerdLog is the path of a real-runtime node's containerd log.
func (n *Node) ContainerdLog() string { return n.cluster.logPath("containerd-" + n.name) }

// nsenter returns the argv prefix that runs a command in the node's
// namespaces, in the working directory wd (entering a mount namespace
// otherwise moves it to /). unshare stays in the host's PID namespace and
// forks the holder into the new one: pid_for_children names it.
func (r *realRuntime) nsenter(wd string) []string {
	pid := strconv.Itoa(r.holder.cmd.Process.Pid)
	return []string{"nsenter", "--mount=/proc/" + pid + "/ns/mnt", "--pid=/proc/" + pid + "/ns/pid_for_children", "--wd=" + wd, "--"}
}

// holderScript runs in the node's new namespaces as their init: it makes the
// mounts ($1 over /var/lib, $2 over /var/log, $3's sysctl stand-ins, $4 over
// /run), says so in /run, and waits, reaping orphans, until SIGTERM.
const holderScript = `set -e
mount --bind "$1" /var/lib
mount --bind "$2" /var/log
mount --bind "$4" /run
mount --bind /proc/sys /proc/sys
mount -o remount,bind,ro /proc/sys
for f in "$3"/*; do mount --bind "$f" "/proc/sys/$(basename "$f" | tr . /)"; done
touch /run/node-namespace-ready
trap 'exit 0' TERM INT
while :; do sleep 86400 & wait $!; done`

// startRealRuntime starts the node's namespaces and containerd, and imports
// the pause and busybox images from archive.
func startRealRuntime(ctx context.Context, n *Node, bins RuntimeBinaries, index int, sysctlDir, archive string) (*realRuntime, error) {
	r := &realRuntime{node: n, dir: filepath.Join(n.dir, "containerd"), bins: bins, index: index}
	runDir := filepath.Join(n.dir, "var-run")
	for _, d := range []string{r.dir, runDir, filepath.Join(r.dir, "net.d")} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			return nil, fmt.Errorf("create %s: %w", d, err)
		}
	}
	if err := r.writeConfig(); err != nil {
		return nil, err
	}
	argv := []string{"unshare", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc", "--propagation", "private",
		"sh", "-c", holderScript, "node-ns",
		filepath.Join(n.dir, "var-lib"), filepath.Join(n.dir, "var-log"), sysctlDir, runDir}
	var err error
	r.holder, err = startProcess(ctx, "namespace of node "+n.name, filepath.Join(n.dir, "run"), n.cluster.logPath("node-ns-"+n.name), argv)
	if err != nil {
		return nil, err
	}
	ready := filepath.Join(runDir, "node-namespace-ready")
	if err := r.holder.waitFor(ctx, "mounts", 30*time.Second, func(context.Context) error {
		_, err := os.Stat(ready)
		return err
	}); err != nil {
		r.stop(ctx)
		return nil, err
	}

	argv = append(r.nsenter(filepath.Join(n.dir, "run")), "env", "PATH="+filepath.Dir(bins.Containerd)+":/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
		bins.Containerd, "--config", filepath.Join(r.dir, "config.toml"))
	r.daemon, err = startProcess(ctx, "containerd "+n.name, filepath.Join(n.dir, "run"), n.ContainerdLog(), argv)
	if err != nil {
		r.stop(ctx)
		return nil, err
	}
	if err := r.daemon.waitFor(ctx, "CRI ready", 60*time.Second, r.criReady); err != nil {
		r.stop(ctx)
		return nil, err
	}
	if err := r.ctr(ctx, "images", "import", archive); err != nil {
		r.stop(ctx)
		return nil, err
	}
	return r, nil
}

// writeConfig writes containerd's configuration (version 4, v2.4's own;
// imports nothing from the host's /etc/containerd) and the CNI network.
// restrict_oom_score_adj keeps OOM scores at or above containerd's own: a
// host whose bounding set lacks CAP_SYS_RESOURCE (these machines) cannot
// lower a score below 0, and runc would fail every pod sandbox (-998) with
// "failed to update /proc/self/oom_score_adj: Permission denied".
// Everything containerd keeps lives below r.dir; CDI specs are read from the
// node's CDI dir (containerd 2 always injects CDI devices; the old
// enable_cdi setting is ignored).
func (r *realRuntime) writeConfig() error {
	q := strconv.Quote
	config := fmt.Sprintf(`version = 4
root = %s
state = %s
imports = []
disabled_plugins = ["io.containerd.nri.v1.nri", "io.containerd.internal.v1.tracing", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.erofs", "io.containerd.image-verifier.v1.bindir"]

[plugins."io.containerd.server.v1.grpc"]
  address = %s

[plugins."io.containerd.server.v1.ttrpc"]
  address = %s

[plugins."io.containerd.internal.v1.opt"]
  path = %s

[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = %s

[plugins."io.containerd.cri.v1.runtime"]
  cdi_spec_dirs = [%s]
  netns_mounts_under_state_dir = true
  restrict_oom_score_adj = true
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = %s
        Root = %s
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = [%s]
    conf_dir = %s
`,
		q(filepath.Join(r.dir, "root")), q(filepath.Join(r.dir, "state")),
		q(r.socket()), q(r.socket()+".ttrpc"), q(filepath.Join(r.dir, "opt")),
		q(ociimage.PauseName), q(r.node.CDIDir()),
		q(r.bins.Runc), q(filepath.Join(r.dir, "state", "runc")),
		q(r.bins.CNIDir), q(filepath.Join(r.dir, "net.d")))
	if err := os.WriteFile(filepath.Join(r.dir, "config.toml"), []byte(config), 0o600); err != nil {
		return fmt.Errorf("write containerd configuration: %w", err)
	}
	// The bridge and its host-side address exist already (podNetwork):
	// the plugin attaches pods and sets no address, route or sysctl.
	pods := r.node.cluster.pods
	first, last := pods.nodeRange(r.index)
	network := map[string]any{
		"cniVersion": "1.0.0",
		"name":       "tessera-pods",
		"plugins": []any{map[string]any{
			"type":        "bridge",
			"bridge":      pods.bridge,
			"isGateway":   false,
			"ipMasq":      false,
			"hairpinMode": false,
			"ipam": map[string]any{
				"type": "host-local",
				"ranges": [][]map[string]string{{{
					"subnet": pods.subnet.String(), "rangeStart": first.String(), "rangeEnd": last.String(),
					"gateway": pods.gateway.String(),
				}}},
				"dataDir": filepath.Join(r.dir, "ipam"),
			},
		}},
	}
	data, err := json.MarshalIndent(network, "", "  ")
	if err != nil {
		return fmt.Errorf("encode CNI network: %w", err)
	}
	if err := os.WriteFile(filepath.Join(r.dir, "net.d", "10-tessera.conflist"), data, 0o600); err != nil {
		return fmt.Errorf("write CNI network: %w", err)
	}
	return nil
}

// criReady reports whether containerd's CRI says the runtime and the network
// are ready, as the kubelet will ask. Other conditions are not required:
// containerd 2.4 reports ContainerdHasNoDeprecationWarnings false on these
// cgroup v1 hosts.
func (r *realRuntime) criReady(ctx context.Context) error {
	conn, err := grpc.NewClient("unix://"+r.socket(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	resp, err := runtimeapi.NewRuntimeServiceClient(conn).Status(ctx, &runtimeapi.StatusRequest{})
	if err != nil {
		return err
	}
	for _, c := range resp.GetStatus().GetConditions() {
		if (c.GetType() == runtimeapi.RuntimeReady || c.GetType() == runtimeapi.NetworkReady) && !c.GetStatus() {
			return fmt.Errorf("%s is false: %s: %s", c.GetType(), c.GetReason(), c.GetMessage())
		}
	}
	return nil
}

// ctr runs containerd's client against the node's containerd, in the CRI's
// namespace.
func (r *realRuntime) ctr(ctx context.Context, args ...string) error {
	argv := append([]string{"--address", r.socket(), "--namespace", "k8s.io"}, args...)
	out, err := exec.CommandContext(ctx, r.bins.Ctr, argv...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("node %s: ctr %s: %w\n%s\nlast log lines of %s:\n%s", r.node.name, strings.Join(args, " "), err, out,
			r.node.ContainerdLog(), tail(r.node.ContainerdLog(), 20))
	}
	return nil
}

// stop removes every pod sandbox through the CRI (containerd stops their
// containers, unmounts and tears their networks down), stops containerd and
// ends the namespaces (killing whatever is left in them).
func (r *realRuntime) stop(ctx context.Context) {
	logger := klog.FromContext(ctx)
	if r.daemon != nil {
		if done, _ := r.daemon.exited(); !done {
			if err := r.removeSandboxes(ctx); err != nil {
				logger.Error(err, "Removing pod sandboxes failed; killing them with the node's namespace", "node", r.node.name)
			}
		}
		r.daemon.stop(10 * time.Second)
	}
	r.holder.stop(5 * time.Second)
	// containerd puts pod cgroups below k8s.io (named after its CRI
	// namespace; the kubelet gives no parent without cgroupsPerQOS) and
	// leaves that parent behind; removing it fails while another node's
	// containers use it.
	parents, _ := filepath.Glob("/sys/fs/cgroup/*/k8s.io")
	for _, p := range parents {
		_ = os.Remove(p)
	}
}

func (r *realRuntime) removeSandboxes(ctx context.Context) error {
	conn, err := grpc.NewClient("unix://"+r.socket(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	// Stopping runs also when the cluster's context has ended.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	client := runtimeapi.NewRuntimeServiceClient(conn)
	list, err := client.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{})
	if err != nil {
		return fmt.Errorf("list pod sandboxes: %w", err)
	}
	for _, s := range list.GetItems() {
		if _, err := client.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: s.GetId()}); err != nil {
			return fmt.Errorf("stop pod sandbox %s: %w", s.GetId(), err)
		}
		if _, err := client.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: s.GetId()}); err != nil {
			return fmt.Errorf("remove pod sandbox %s: %w", s.GetId(), err)
		}
	}
	return nil
}

// ContainerLog returns what a container of the pod wrote (stdout and stderr,
// in order) in its first run, from the log file the runtime keeps for the
// kubelet (/var/log/pods in the node's namespace). Only a real-runtime
// node's containers write anything.
func (n *Node) ContainerLog(namespace, pod, podUID, container string) (string, error) {
	file := filepath.Join(n.dir, "var-log", "pods", namespace+"_"+pod+"_"+podUID, container, "0.log")
	data, err := os.ReadFile(file)
	if err != nil {
		return "", fmt.Errorf("node %s: read the log of container %s of pod %s/%s: %w", n.name, container, namespace, pod, err)
	}
	// The CRI log format: "<time> <stream> <P|F> <text>", P marking a line
	// the runtime split.
	var b strings.Builder
	for _, line := range strings.Split(strings.TrimSuffix(string(data), "\n"), "\n") {
		fields := strings.SplitN(line, " ", 4)
		if len(fields) < 3 {
			continue
		}
		text := ""
		if len(fields) == 4 {
			text = fields[3]
		}
		b.WriteString(text)
		if fields[2] != "P" {
			b.WriteString("\n")
		}
	}
	return b.String(), nil
}

// ImportImages imports the images of an OCI archive (test/ociimage's
// WriteArchive) into a real-runtime node's containerd, where the kubelet
// finds them under their names; pods must not pull them (imagePullPolicy
// Never).
func (n *Node) ImportImages(ctx context.Context, archive string) error {
	if n.real == nil {
		return fmt.Errorf("node %s runs no real container runtime: it cannot hold images", n.name)
	}
	return n.real.ctr(ctx, "images", "import", archive)
}

// ReadFile reads a file as a real-runtime node's processes see it, in the
// node's mount namespace: the volumes the kubelet mounts for pods (tmpfs
// projected tokens) are visible only there.
func (n *Node) ReadFile(path string) ([]byte, error) {
	if n.real == nil {
		return nil, fmt.Errorf("node %s runs no real container runtime", n.name)
	}
	return os.ReadFile(filepath.Join("/proc", strconv.Itoa(n.real.holder.cmd.Process.Pid), "root", path))
}

// Glob is filepath.Glob in a real-runtime node's mount namespace; the
// matches are paths there.
func (n *Node) Glob(pattern string) ([]string, error) {
	if n.real == nil {
		return nil, fmt.Errorf("node %s runs no real container runtime", n.name)
	}
	root := filepath.Join("/proc", strconv.Itoa(n.real.holder.cmd.Process.Pid), "root")
	matches, err := filepath.Glob(filepath.Join(root, pattern))
	for i, m := range matches {
		matches[i] = strings.TrimPrefix(m, root)
	}
	return matches, err
}

// RuncRoot is runc's state directory on a real-runtime node (below it
// <containerd namespace>/<container ID>/state.json); empty on other nodes.
func (n *Node) RuncRoot() string {
	if n.real == nil {
		return ""
	}
	return filepath.Join(n.real.dir, "state", "runc")
}
