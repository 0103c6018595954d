// Package imex runs NVIDIA IMEX daemons for gang domain claims on an NVLink
// domain: one daemon per claim on each node of the gang, as a pod on the
// plugin's node, configured with exactly the gang's nodes.
//
// CUDA shares memory between the nodes of a multi-node NVLink domain (GB200
// NVL72) only through IMEX: on every node that takes part, nvidia-imex (from
// the driver) runs with a nodes configuration listing the addresses of all
// of them and listens on its TCP port for its peers
// (https://docs.nvidia.com/multi-node-nvlink-systems/imex-guide/config.html).
// The gang controller writes the placement's nodes and their InternalIP
// addresses on the domain claim (gang.tessera.dev/nodes) with the
// allocation; the plugin of each of those nodes, preparing the claim, writes
// the configuration into the claim's directory and starts the daemon before
// the prepare completes, so no member's containers start before their node's
// daemon is ready. The last member's unprepare on a node stops it.
//
// Why a pod (host network, the driver root mounted read-only, Tessera's
// image), as for MPS: the plugin runs no host binaries, and the kubelet
// supervises the daemon (restarts it, reports its readiness through a TCP
// probe of its port, shows its log). The controller reports the daemons'
// readiness on the gang (condition IMEXReady).
//
// The contract, relied on by the prepare state machine (as for MPS):
//   - Locate is a pure function of the claim UID, so the daemon's pod and
//     directory are checkpointed before anything exists.
//   - Start and Stop are idempotent: a retried prepare finds the pod
//     serving (or replaces one configured for other nodes); a retried
//     unprepare finds it gone.
//   - Every daemon pod carries the node and claim UID as labels, so the
//     daemon sweep deletes daemons whose claims the node no longer holds.
package imex

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/klog/v2"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/daemonpod"
	"github.com/tessera-dev/tessera/driver/prepare"
)

// AppName is the app label of every IMEX daemon pod.
const AppName = "tessera-imex"

// AnnotationNodes, on a daemon pod, lists the addresses its configuration
// holds (comma-separated, in the file's order): a retried prepare compares
// it with the claim's and replaces a daemon of another placement.
const AnnotationNodes = "gpu.tessera.dev/imex-nodes"

// Where the daemon sees its configuration, and the files' names.
const (
	ConfigDir       = "/etc/nvidia-imex"
	ConfigFile      = "config.cfg"
	NodesConfigFile = "nodes_config.cfg"
	// DefaultPort is IMEX's documented SERVER_PORT default.
	DefaultPort = 50000
	// Binary is the daemon under the driver root.
	Binary = "usr/bin/nvidia-imex"
)

// Daemons runs IMEX daemon pods on one node; Host.Dir holds each daemon's
// configuration, one subdirectory per claim.
type Daemons struct {
	daemonpod.Host
	// Port is the daemons' TCP port (SERVER_PORT); zero means DefaultPort.
	Port int
}

var _ prepare.IMEXDaemons = (*Daemons)(nil)

// Locate names a claim's daemon pod and directory. Every node of the gang
// runs a daemon for the same claim, so the pod's name holds the node's:
// "tessera-imex-<claim UID>-<node>", or a hash of the node's name where
// that would be longer than a pod's name may be.
func (d *Daemons) Locate(claimUID string) checkpoint.Daemon {
	name := "tessera-imex-" + claimUID + "-" + d.NodeName
	if len(name) > 253 {
		sum := sha256.Sum256([]byte(d.NodeName))
		name = "tessera-imex-" + claimUID + "-" + hex.EncodeToString(sum[:8])
	}
	return checkpoint.Daemon{Pod: name, Dir: filepath.Join(d.Dir, claimUID)}
}

func (d *Daemons) port() int {
	if d.Port == 0 {
		return DefaultPort
	}
	return d.Port
}

// Config renders the daemon's two files: its configuration and its nodes
// configuration. It fails, naming the fix, when the gang's nodes lack this
// node or an address.
func (d *Daemons) Config(daemon prepare.IMEXDaemon) (config, nodes string, err error) {
	ref := daemon.ClaimNamespace + "/" + daemon.ClaimName
	if len(daemon.Nodes) == 0 {
		return "", "", fmt.Errorf("claim %s: annotation %s is missing, so the gang's nodes are unknown and no IMEX daemon can be configured; the claim was allocated by something other than tessera-controller (a gang domain claim must be placed by it), or by a version before IMEX daemons", ref, gangv1.AnnotationNodes)
	}
	var self string
	var b strings.Builder
	seen := map[string]bool{}
	for _, n := range daemon.Nodes {
		ip := net.ParseIP(n.Address)
		if ip == nil {
			return "", "", fmt.Errorf("claim %s: node %s has no usable address (%q) in annotation %s; IMEX needs every node of the gang to report an InternalIP in its status", ref, n.Name, n.Address, gangv1.AnnotationNodes)
		}
		if seen[ip.String()] {
			return "", "", fmt.Errorf("claim %s: address %s appears twice in annotation %s; each node of an IMEX domain needs its own InternalIP", ref, ip, gangv1.AnnotationNodes)
		}
		seen[ip.String()] = true
		if n.Name == d.NodeName {
			self = ip.String()
		}
		b.WriteString(ip.String() + "\n")
	}
	if self == "" {
		return "", "", fmt.Errorf("claim %s: this node (%s) is not among the gang's nodes in annotation %s; the claim's allocation and its annotation disagree", ref, d.NodeName, gangv1.AnnotationNodes)
	}
	config = fmt.Sprintf("# Written by Tessera's kubelet plugin for claim %s; replaced when the claim is prepared again.\nDAEMONIZE=0\nSERVER_PORT=%d\nBIND_INTERFACE_IP=%s\nIMEX_NODE_CONFIG_FILE=%s\n",
		ref, d.port(), self, ConfigDir+"/"+NodesConfigFile)
	return config, b.String(), nil
}

// Start writes the daemon's configuration, runs its pod (replacing one
// configured for other nodes) and waits until it is ready.
func (d *Daemons) Start(ctx context.Context, daemon prepare.IMEXDaemon) error {
	if !d.Runs() {
		return fmt.Errorf("IMEX daemon %s: the plugin runs without an IMEX daemon image (--imex-image)", daemon.Pod)
	}
	config, nodes, err := d.Config(daemon)
	if err != nil {
		return err
	}
	if err := d.checkOwnAddress(ctx, daemon); err != nil {
		return err
	}
	addresses := strings.Join(strings.Fields(nodes), ",")
	if err := os.MkdirAll(daemon.Dir, 0o755); err != nil {
		return fmt.Errorf("IMEX directory: %w", err)
	}
	for name, content := range map[string]string{ConfigFile: config, NodesConfigFile: nodes} {
		if err := writeFile(filepath.Join(daemon.Dir, name), content); err != nil {
			return fmt.Errorf("IMEX configuration: %w", err)
		}
	}
	pod := d.Pod(daemon, addresses)
	// A daemon of an earlier placement of the claim is replaced: the
	// nodes configuration is read once, at its start.
	sameNodes := func(existing *corev1.Pod) bool { return existing.Annotations[AnnotationNodes] == addresses }
	if err := d.Ensure(ctx, pod, sameNodes, "IMEX daemon"); err != nil {
		return err
	}
	if err := daemonpod.Wait(ctx, d.Client, d.Namespace, pod.Name, daemonpod.Ready, d.ReadyTimeout, "IMEX daemon", "the gang's channel cannot work without it; check the pod's log and events, and that "+Binary+" exists under the driver root"); err != nil {
		return fmt.Errorf("claim %s/%s: %w", daemon.ClaimNamespace, daemon.ClaimName, err)
	}
	klog.FromContext(ctx).V(2).Info("IMEX daemon ready", "pod", klog.KRef(d.Namespace, pod.Name), "claim", klog.KRef(daemon.ClaimNamespace, daemon.ClaimName), "nodes", addresses)
	return nil
}

// checkOwnAddress checks that the address the claim gives this node is one
// of the Node's InternalIPs: the annotation is only as trustworthy as
// whoever could write the claim, and the daemon binds and serves there.
func (d *Daemons) checkOwnAddress(ctx context.Context, daemon prepare.IMEXDaemon) error {
	var own string
	for _, n := range daemon.Nodes {
		if n.Name == d.NodeName {
			own = n.Address
		}
	}
	node, err := d.Client.CoreV1().Nodes().Get(ctx, d.NodeName, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("read node %s for its address: %w", d.NodeName, err)
	}
	var have []string
	for _, a := range node.Status.Addresses {
		if a.Type == corev1.NodeInternalIP {
			if a.Address == own {
				return nil
			}
			have = append(have, a.Address)
		}
	}
	return fmt.Errorf("claim %s/%s: annotation %s gives this node (%s) the address %s, which is not one of its InternalIPs %v; the gang controller writes it from the Node: was it edited?", daemon.ClaimNamespace, daemon.ClaimName, gangv1.AnnotationNodes, d.NodeName, own, have)
}

// writeFile replaces path with content atomically.
func writeFile(path, content string) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// Pod is the daemon's pod: pinned to this node, in the host's network
// (its peers reach it at the node's address), restarted when it exits,
// tolerating every taint, ready when its port accepts connections. It is
// the only pod the chart's IMEX-lock admission policy lets the plugin's
// token create (deployments/rbac/imex-lock.yaml): this node, the chart's
// image, the daemon's command, the default service account without a
// token, host network and nothing else of the host's namespaces, and host
// directories limited to the claim's directory under Dir (read-only) and
// the driver root (read-only). Change both together
// (TestHelmChartAppliesOnTheAPIServer creates this pod with a node's token).
func (d *Daemons) Pod(daemon prepare.IMEXDaemon, addresses string) *corev1.Pod {
	port := int32(d.port())
	pod := d.Host.Pod(daemon.Pod, AppName, daemon.ClaimUID, daemon.ClaimNamespace+"/"+daemon.ClaimName, corev1.Container{
		Name:    "imex-daemon",
		Command: []string{daemonpod.DriverRootMount + "/" + Binary, "-c", ConfigDir + "/" + ConfigFile},
		Env:     []corev1.EnvVar{{Name: "LD_LIBRARY_PATH", Value: daemonpod.LibraryPath()}},
		// The host port makes the kubelet refuse a second daemon on the
		// port instead of letting it crash.
		Ports: []corev1.ContainerPort{{Name: "imex", ContainerPort: port, HostPort: port, Protocol: corev1.ProtocolTCP}},
		ReadinessProbe: &corev1.Probe{
			ProbeHandler:     corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromInt32(port)}},
			PeriodSeconds:    1,
			FailureThreshold: 3,
		},
		// A daemon that exits with an error shows its last words in the
		// pod's status, and so in the prepare error.
		TerminationMessagePolicy: corev1.TerminationMessageFallbackToLogsOnError,
		VolumeMounts: []corev1.VolumeMount{
			{Name: "config", MountPath: ConfigDir, ReadOnly: true},
			{Name: "driver-root", MountPath: daemonpod.DriverRootMount, ReadOnly: true},
		},
	},
		daemonpod.HostDirectory("config", daemon.Dir),
		daemonpod.HostDirectory("driver-root", d.DriverRoot),
	)
	pod.Annotations[AnnotationNodes] = addresses
	// Its peers reach it at the node's address.
	pod.Spec.HostNetwork = true
	return pod
}

// Stop deletes the daemon's pod, waits until it is gone (its port is
// free for the node's next daemon), and removes its directory.
func (d *Daemons) Stop(ctx context.Context, daemon checkpoint.Daemon) error {
	return d.Host.Stop(ctx, daemon, true, "IMEX daemon")
}

// Claims lists the claim UIDs of this node's daemons, for the daemon sweep.
func (d *Daemons) Claims(ctx context.Context) ([]string, error) {
	return d.Host.Claims(ctx, AppName)
}
