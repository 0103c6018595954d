package cluster

import (
	"context"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/tessera-dev/tessera/test/ociimage"
)

// NodeSpec describes one simulated node.
type NodeSpec struct {
	Name   string
	Labels map[string]string
	// Runtime is the node's container runtime: the fake one by default.
	Runtime Runtime
}

// Runtime is a node's container runtime.
type Runtime int

const (
	// FakeRuntime is k8s.io/cri-client's fake runtime in the test process:
	// containers are records (Node.Containers), nothing runs. Cheap enough
	// for many nodes.
	FakeRuntime Runtime = iota
	// RealContainerd is containerd with runc and a CNI bridge network
	// (containerd.go): containers run, CDI devices are injected by
	// containerd and created by runc. The node imports the pause image and
	// BusyboxImage.
	RealContainerd
)

// RuntimeLabel is the label a real-runtime node carries with the value
// RealContainerdLabelValue: pods that must really run select it.
const (
	RuntimeLabel             = "test.tessera.dev/runtime"
	RealContainerdLabelValue = "containerd"
)

// BusyboxImage is the workload image every real-runtime node holds (Debian's
// busybox-static, built by test/ociimage). Pods must not pull it: use
// imagePullPolicy Never or IfNotPresent.
const BusyboxImage = ociimage.BusyboxName

// Node is a real kubelet in a private mount namespace plus its runtime.
// Its directory (Dir/nodes/<name>) holds the kubelet root dir, the CDI spec
// dir, the scratch dirs mounted over /var/lib and /var/log inside the
// namespace, the runtime socket and the kubelet's configuration.
type Node struct {
	name    string
	dir     string
	cluster *Cluster
	runtime *criRuntime  // FakeRuntime
	real    *realRuntime // RealContainerd
	// standardPaths: the kubelet root and CDI dirs are where a real node
	// keeps them, /var/lib/kubelet and /var/run/cdi in the node's namespace
	// (RealContainerd).
	standardPaths bool
	argv          []string
	healthzPort   int
	ip            string // IP

	mu      sync.Mutex
	kubelet *process
}

// Name is the node's name.
func (n *Node) Name() string { return n.name }

// IP is the node's address, its kubelet's --node-ip and the address the
// kubelet serves its API on. A real-runtime node has its own address on the
// pod bridge (podnetwork.go), distinct per node and not loopback: its Node
// has it as InternalIP, its hostNetwork pods as status.hostIP and podIP,
// the kubelet probes them there, and they can bind to it (as IMEX daemons
// bind to their node's InternalIP). A fake-runtime node's is 127.0.0.1,
// which the kubelet refuses for the Node's addresses: its Node has no
// InternalIP, its hostNetwork pods no hostIP.
func (n *Node) IP() string { return n.ip }

// KubeletRootDir is the kubelet's --root-dir. On a real-runtime node it is
// also /var/lib/kubelet in the node's namespace, so a DaemonSet's hostPath
// volumes with the usual paths (the Helm chart's defaults) reach it; the
// path returned is the same directory seen from the host (and the node).
func (n *Node) KubeletRootDir() string {
	if n.standardPaths {
		return filepath.Join(n.dir, "var-lib", "kubelet")
	}
	return filepath.Join(n.dir, "kubelet")
}

// NodeKubeletDir is a real-runtime node's kubelet root dir as the node's
// processes (kubelet, containerd, containers) see it; KubeletRootDir is the
// same directory seen from the host. The kubelet's mounts for pods (e.g.
// projected tokens) below it are visible only in the node's namespace
// (Node.ReadFile).
const NodeKubeletDir = "/var/lib/kubelet"

// kubeletRootArg is the kubelet's --root-dir. A real-runtime node's kubelet
// gets the short path of its namespace: unix socket paths are limited to
// 107 bytes, and the kubelet dials plugins' registration sockets below it
// (the chart's are named after the plugin's pod UID).
func (n *Node) kubeletRootArg() string {
	if n.standardPaths {
		return NodeKubeletDir
	}
	return n.KubeletRootDir()
}

// RegistrarDir is where the kubelet looks for plugin registration sockets.
func (n *Node) RegistrarDir() string { return filepath.Join(n.KubeletRootDir(), "plugins_registry") }

// PluginsDir is where plugins put their own sockets and data.
func (n *Node) PluginsDir() string { return filepath.Join(n.KubeletRootDir(), "plugins") }

// CDIDir is the node's CDI spec directory: give it to the plugin as
// --cdi-root; the node's runtime resolves CDI devices from it. On a
// real-runtime node it is also /var/run/cdi in the node's namespace.
func (n *Node) CDIDir() string {
	if n.standardPaths {
		return filepath.Join(n.dir, "var-run", "cdi")
	}
	return filepath.Join(n.dir, "cdi")
}

// Containers returns every container the fake runtime created on this node,
// with the OCI spec it got after CDI injection, oldest first. A real-runtime
// node records nothing: ask its containers what they got.
func (n *Node) Containers() []RecordedContainer {
	if n.runtime == nil {
		return nil
	}
	return n.runtime.recorded()
}

// KubeletLog is the path of the kubelet's log file.
func (n *Node) KubeletLog() string { return n.cluster.logPath("kubelet-" + n.name) }

func (c *Cluster) newNode(ctx context.Context, spec NodeSpec) (*Node, error) {
	n := &Node{name: spec.Name, dir: nodeDir(c.dir, spec.Name), cluster: c, standardPaths: spec.Runtime == RealContainerd, ip: "127.0.0.1"}
	for _, d := range []string{n.KubeletRootDir(), n.RegistrarDir(), n.PluginsDir(), n.CDIDir(),
		filepath.Join(n.dir, "var-lib"), filepath.Join(n.dir, "var-log")} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			return nil, fmt.Errorf("node %s: create %s: %w", n.name, d, err)
		}
	}
	ports, err := FreePorts(2)
	if err != nil {
		return nil, err
	}
	n.healthzPort = ports[1]
	realIndex := c.realNodes // among the real-runtime nodes
	if spec.Runtime == RealContainerd {
		c.realNodes++
		ip, err := c.pods.addNodeIP(realIndex)
		if err != nil {
			return nil, fmt.Errorf("node %s: %w", n.name, err)
		}
		n.ip = ip.String()
	}

	user := "system:node:" + n.name
	client, err := c.ca.issue(n.dir, "kubelet-client", user, []string{"system:nodes"}, nil)
	if err != nil {
		return nil, err
	}
	// The API server reaches the kubelet at its InternalIP (real-runtime
	// nodes only) and checks its certificate.
	serving, err := c.ca.issue(n.dir, "kubelet-serving", user, []string{"system:nodes"}, []string{n.ip, n.name})
	if err != nil {
		return nil, err
	}
	kubeconfig := filepath.Join(n.dir, "kubelet.kubeconfig")
	if err := writeKubeconfig(kubeconfig, c.server, c.ca.certPEM, user,
		credentials{certPEM: client.CertPEM, keyPEM: client.KeyPEM}); err != nil {
		return nil, err
	}
	sysctlDir := filepath.Join(n.dir, "sysctl")
	if err := writeSysctlStandIns(sysctlDir); err != nil {
		return nil, fmt.Errorf("node %s: %w", n.name, err)
	}
	socket := filepath.Join(n.dir, "cri.sock")
	if spec.Runtime == RealContainerd {
		archive, err := c.nodeImages(ctx)
		if err != nil {
			return nil, fmt.Errorf("node %s: %w", n.name, err)
		}
		if n.real, err = startRealRuntime(ctx, n, c.runtimeBins, realIndex, sysctlDir, archive); err != nil {
			return nil, fmt.Errorf("node %s: %w", n.name, err)
		}
		socket = n.real.socket()
	} else if n.runtime, err = startRuntime(ctx, socket, n.CDIDir(), filepath.Join(n.dir, "var-log")); err != nil {
		return nil, fmt.Errorf("node %s: %w", n.name, err)
	}
	config := filepath.Join(n.dir, "kubelet.yaml")
	if err := writeKubeletConfig(config, kubeletConfig(socket, caFile(c.pkiDir()), serving, n.ip, ports[0], ports[1], c.gates)); err != nil {
		return nil, fmt.Errorf("node %s: %w", n.name, err)
	}

	// The kubelet writes to some fixed host paths whatever --root-dir says
	// (/var/lib/kubelet/device-plugins, /var/lib/kubelet/pki,
	// /var/log/containers) and sets host-wide sysctls, so it runs in its
	// own mount namespace with scratch dirs mounted over /var/lib and
	// /var/log, /proc/sys read-only, and stand-in files over the sysctls
	// it checks. Mounts made there, including the kubelet's own volume
	// mounts, vanish with the namespace.
	// A real-runtime node's kubelet joins the namespaces its containerd
	// runs in (containerd.go), where the same mounts are made.
	n.argv = []string{"unshare", "-m", "--propagation", "private", "sh", "-c", nodeNamespaceScript, "kubelet-ns",
		filepath.Join(n.dir, "var-lib"), filepath.Join(n.dir, "var-log"), sysctlDir}
	if n.real != nil {
		n.argv = n.real.nsenter(filepath.Join(n.dir, "run"))
	}
	n.argv = append(n.argv,
		c.bins.Kubelet,
		"--config="+config,
		"--kubeconfig="+kubeconfig,
		"--root-dir="+n.kubeletRootArg(),
		"--hostname-override="+n.name,
		// A real-runtime node's own address (IP): the Node's InternalIP.
		// A fake-runtime node's kubelet gets 127.0.0.1, which it refuses
		// for the Node's addresses and logs so at each status update
		// ("nodeIP can't be loopback address"): its Node has no
		// InternalIP, so the API server cannot reach it (logs, exec), and
		// every fake node stays on loopback, however many there are.
		"--node-ip="+n.ip,
		"--v=3",
	)
	labels := maps.Clone(spec.Labels)
	if spec.Runtime == RealContainerd {
		if labels == nil {
			labels = map[string]string{}
		}
		labels[RuntimeLabel] = RealContainerdLabelValue
	}
	if len(labels) > 0 {
		var pairs []string
		for k, v := range labels {
			pairs = append(pairs, k+"="+v)
		}
		sort.Strings(pairs)
		n.argv = append(n.argv, "--node-labels="+strings.Join(pairs, ","))
	}
	return n, nil
}

// nodeNamespaceScript prepares a kubelet's mount namespace, then runs the
// kubelet: $1 goes over /var/lib, $2 over /var/log, each file in $3 (named
// like vm.overcommit_memory) over the matching /proc/sys entry.
const nodeNamespaceScript = `set -e
mount --bind "$1" /var/lib
mount --bind "$2" /var/log
mount --bind /proc/sys /proc/sys
mount -o remount,bind,ro /proc/sys
for f in "$3"/*; do mount --bind "$f" "/proc/sys/$(basename "$f" | tr . /)"; done
shift 3
exec "$@"`

// kubeletSysctls are the host-wide kernel settings the kubelet checks at
// start and, unless protectKernelDefaults is set, changes (kernel.panic=10,
// vm.overcommit_memory=1, ...). Inside a node's namespace stand-in files
// with these values cover them, so the kubelet finds them as it wants them
// and the host keeps its own.
var kubeletSysctls = map[string]int{
	"vm.overcommit_memory":      1,
	"vm.panic_on_oom":           0,
	"kernel.panic":              10,
	"kernel.panic_on_oops":      1,
	"kernel.keys.root_maxkeys":  1000000,
	"kernel.keys.root_maxbytes": 25000000,
}

func writeSysctlStandIns(dir string) error {
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return fmt.Errorf("create sysctl stand-in dir: %w", err)
	}
	for name, value := range kubeletSysctls {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(fmt.Sprintf("%d\n", value)), 0o644); err != nil {
			return fmt.Errorf("write sysctl stand-in %s: %w", name, err)
		}
	}
	return nil
}

// kubeletConfig is the KubeletConfiguration that lets a kubelet run on a
// shared host next to other kubelets, with a fake runtime and cgroup v1. It
// serves its API at address:port, the node's IP, and /healthz at
// 127.0.0.1:healthzPort.
func kubeletConfig(socket, clientCA string, serving *keyPair, address string, port, healthzPort int, gates map[string]bool) map[string]any {
	return map[string]any{
		"apiVersion":               "kubelet.config.k8s.io/v1beta1",
		"kind":                     "KubeletConfiguration",
		"address":                  address,
		"port":                     port,
		"readOnlyPort":             0,
		"healthzBindAddress":       "127.0.0.1",
		"healthzPort":              healthzPort,
		"tlsCertFile":              serving.CertFile,
		"tlsPrivateKeyFile":        serving.KeyFile,
		"containerRuntimeEndpoint": "unix://" + socket,
		"imageServiceEndpoint":     "unix://" + socket,
		"failCgroupV1":             false,
		"cgroupDriver":             "cgroupfs",
		"cgroupsPerQOS":            false,
		"enforceNodeAllocatable":   []string{},
		"failSwapOn":               false,
		// A PodGroup's claims are prepared for its pods only with the
		// gates on (the kubelet checks the claim's PodGroup owner).
		"featureGates": gates,
		"authentication": map[string]any{
			"anonymous": map[string]any{"enabled": false},
			"webhook":   map[string]any{"enabled": false},
			"x509":      map[string]any{"clientCAFile": clientCA},
		},
		"authorization":                 map[string]any{"mode": "AlwaysAllow"},
		"evictionHard":                  map[string]string{"nodefs.available": "0%", "nodefs.inodesFree": "0%", "imagefs.available": "0%"},
		"imageGCHighThresholdPercent":   100,
		"imageGCLowThresholdPercent":    99,
		"localStorageCapacityIsolation": false,
		"serializeImagePulls":           false,
		"resolvConf":                    "",
		"clusterDomain":                 "cluster.local",
	}
}

func writeKubeletConfig(path string, config map[string]any) error {
	data, err := yaml.Marshal(config)
	if err != nil {
		return fmt.Errorf("encode kubelet configuration: %w", err)
	}
	if err := os.WriteFile(path, data, 0o600); err != nil {
		return fmt.Errorf("write kubelet configuration %s: %w", path, err)
	}
	return nil
}

// StartKubelet starts the node's kubelet and waits until it is healthy.
func (n *Node) StartKubelet(ctx context.Context) error { return n.start(ctx, false) }

// StopKubelet stops the node's kubelet. Its runtime, with the containers it
// runs, stays up, as a real node's would.
func (n *Node) StopKubelet() {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.kubelet.stop(10 * time.Second)
	n.kubelet = nil
}

// RestartKubelet stops and starts the node's kubelet.
func (n *Node) RestartKubelet(ctx context.Context) error {
	n.StopKubelet()
	return n.StartKubelet(ctx)
}

// DropContainers makes the node's runtime forget every pod sandbox and
// container, as a reboot does; Containers lists only those created after.
// Stop the kubelet first: a running one would see its pods die one by one
// instead of finding them all gone when it starts.
func (n *Node) DropContainers() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.kubelet != nil {
		return fmt.Errorf("node %s: stop the kubelet before dropping the containers", n.name)
	}
	if n.runtime == nil {
		return fmt.Errorf("node %s: only a fake runtime can drop its containers", n.name)
	}
	n.runtime.dropAll()
	return nil
}

// start starts the kubelet; with waitReady it also waits for the Node
// object to be Ready.
func (n *Node) start(ctx context.Context, waitReady bool) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.kubelet != nil {
		if done, _ := n.kubelet.exited(); !done {
			return fmt.Errorf("node %s: kubelet already running", n.name)
		}
	}
	p, err := startProcess(ctx, "kubelet "+n.name, filepath.Join(n.dir, "run"), n.KubeletLog(), n.argv)
	if err != nil {
		return fmt.Errorf("node %s: %w", n.name, err)
	}
	n.kubelet = p
	if err := p.waitFor(ctx, "healthz", 60*time.Second, httpCheck(fmt.Sprintf("http://127.0.0.1:%d/healthz", n.healthzPort))); err != nil {
		return err
	}
	if !waitReady {
		return nil
	}
	return p.waitFor(ctx, "node Ready", 60*time.Second, func(ctx context.Context) error {
		node, err := n.cluster.client.CoreV1().Nodes().Get(ctx, n.name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		// The node-lifecycle controller removes the not-ready taint a
		// moment after the kubelet reports Ready; until then nothing
		// schedules there.
		for _, taint := range node.Spec.Taints {
			if strings.HasPrefix(taint.Key, "node.kubernetes.io/") {
				return fmt.Errorf("node %s still has taint %s", n.name, taint.ToString())
			}
		}
		for _, cond := range node.Status.Conditions {
			if cond.Type == corev1.NodeReady && cond.Status == corev1.ConditionTrue {
				return nil
			}
		}
		return fmt.Errorf("node %s not Ready", n.name)
	})
}

func (n *Node) stop(ctx context.Context) {
	n.StopKubelet()
	n.runtime.stop()
	if n.real != nil {
		n.real.stop(ctx)
	}
}
