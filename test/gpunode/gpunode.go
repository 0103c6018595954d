// Package gpunode runs Tessera's real kubelet plugin (driver/plugin), in the
// calling process, on a node of a local test cluster (test/cluster), with a
// simulated GPU node (driver/fakenode) behind it that the caller keeps to
// observe NVML state. The plugin uses the node's kubelet directories and the
// service account of deployments/rbac, never admin credentials. The e2e tests
// and the demo share it.
package gpunode

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"

	"github.com/tessera-dev/tessera/deployments/rbac"
	"github.com/tessera-dev/tessera/deviceclass"
	"github.com/tessera-dev/tessera/driver/fakenode"
	"github.com/tessera-dev/tessera/driver/nodeopen"
	"github.com/tessera-dev/tessera/driver/plugin"
	"github.com/tessera-dev/tessera/test/cluster"
)

// DriverName is Tessera's DRA driver name.
const DriverName = "gpu.tessera.dev"

// Install applies what an operator installs before the plugin runs: the
// plugin's RBAC and every DeviceClass, from the files the project ships.
func Install(ctx context.Context, c *cluster.Cluster) error {
	if err := c.Apply(ctx, rbac.KubeletPlugin); err != nil {
		return fmt.Errorf("install kubelet plugin RBAC: %w", err)
	}
	files, err := deviceclass.Files()
	if err != nil {
		return fmt.Errorf("read device classes: %w", err)
	}
	names := make([]string, 0, len(files))
	for name := range files {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		if err := c.Apply(ctx, files[name]); err != nil {
			return fmt.Errorf("install device class %s: %w", name, err)
		}
	}
	return nil
}

// PluginClient is an API client authenticated as the kubelet plugin's
// service account (call Install first), with the plugin's default rate limits.
func PluginClient(ctx context.Context, c *cluster.Cluster) (kubernetes.Interface, error) {
	kubeconfig, err := c.ServiceAccountKubeconfig(ctx, rbac.Namespace, rbac.KubeletPluginAccount)
	if err != nil {
		return nil, err
	}
	return plugin.NewClient(plugin.Options{Kubeconfig: kubeconfig, KubeAPIQPS: 50, KubeAPIBurst: 100})
}

// Node is a cluster node with simulated GPUs and, while started, Tessera's
// kubelet plugin.
type Node struct {
	*cluster.Node
	// Fake is the simulated GPU node the plugin sees through NVML.
	Fake *fakenode.Node
	// Options are the plugin's options, as its flags would set them.
	Options plugin.Options

	ctx    context.Context
	client kubernetes.Interface

	mu     sync.Mutex
	plugin *plugin.Plugin
}

// New simulates the fakenode profile on the cluster node, with its host files
// (sysfs, device nodes, driver libraries) and boot ID under dir. The plugin
// runs with ctx (for its logger and lifetime) once StartPlugin is called.
func New(ctx context.Context, node *cluster.Node, profile, dir string, client kubernetes.Interface) (*Node, error) {
	return NewWith(ctx, node, profile, dir, client, fakenode.Options{})
}

// NewWith is New with fake node options (e.g. Clique, to join several trays
// in one multi-node NVLink clique); Dir and NodeName are set by NewWith.
func NewWith(ctx context.Context, node *cluster.Node, profile, dir string, client kubernetes.Interface, fo fakenode.Options) (*Node, error) {
	fo.Dir, fo.NodeName = filepath.Join(dir, "host"), node.Name()
	fake, err := fakenode.New(profile, fo)
	if err != nil {
		return nil, fmt.Errorf("node %s: %w", node.Name(), err)
	}
	bootID := filepath.Join(dir, "boot_id")
	if err := os.WriteFile(bootID, []byte("6c1e7b8e-0a4f-4d1e-9a57-1f2e3d4c5b6a\n"), 0o644); err != nil {
		return nil, fmt.Errorf("node %s: write boot ID: %w", node.Name(), err)
	}
	// In a real deployment a hostPath volume (DirectoryOrCreate) makes it.
	dataDir := filepath.Join(node.PluginsDir(), DriverName)
	if err := os.MkdirAll(dataDir, 0o750); err != nil {
		return nil, fmt.Errorf("node %s: create plugin data dir: %w", node.Name(), err)
	}
	opts := plugin.Options{
		Node:          nodeopen.Options{NodeName: node.Name(), Opened: &fake.Node},
		CDIRoot:       node.CDIDir(),
		PluginDataDir: dataDir,
		RegistrarDir:  node.RegistrarDir(),
		BootIDFile:    bootID,
		KubeAPIQPS:    50,
		KubeAPIBurst:  100,
		Namespace:     rbac.Namespace,
	}
	if err := opts.Validate(); err != nil {
		return nil, fmt.Errorf("node %s: plugin options: %w", node.Name(), err)
	}
	return &Node{Node: node, Fake: fake, Options: opts, ctx: ctx, client: client}, nil
}

// StartPlugin starts the node's kubelet plugin, with whatever state an
// earlier run left in its data dir, and waits until the kubelet has
// registered it: until then the kubelet fails prepares and backs off.
func (n *Node) StartPlugin() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.plugin != nil {
		return fmt.Errorf("node %s: plugin already running", n.Name())
	}
	before, err := n.DRAPluginRegistrations(DriverName)
	if err != nil {
		return err
	}
	p, err := plugin.Start(n.ctx, n.Options, n.client)
	if err != nil {
		return fmt.Errorf("node %s: start plugin: %w", n.Name(), err)
	}
	n.plugin = p
	return n.WaitRegistered(n.ctx, before)
}

// StopPlugin stops the plugin as a terminating DaemonSet pod would: it
// unregisters from the kubelet and leaves its slices, checkpoint and CDI
// specs behind. Stopping a stopped plugin does nothing.
func (n *Node) StopPlugin() {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.plugin != nil {
		n.plugin.Stop()
		n.plugin = nil
	}
}

// WaitRegistered waits until the node's kubelet has registered the plugin
// more than before times (cluster.Node.DRAPluginRegistrations).
func (n *Node) WaitRegistered(ctx context.Context, before int) error {
	err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, time.Minute, true, func(context.Context) (bool, error) {
		count, err := n.DRAPluginRegistrations(DriverName)
		return count > before, err
	})
	if err != nil {
		return fmt.Errorf("node %s: the kubelet did not register the plugin (see %s): %w", n.Name(), n.KubeletLog(), err)
	}
	return nil
}

// SliceIDs maps the names of a node's Tessera ResourceSlices to their UIDs.
type SliceIDs map[string]types.UID

// ListSlices returns the node's Tessera ResourceSlices.
func ListSlices(ctx context.Context, client kubernetes.Interface, node string) (SliceIDs, error) {
	list, err := client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{
		FieldSelector: "spec.driver=" + DriverName + ",spec.nodeName=" + node,
	})
	if err != nil {
		return nil, fmt.Errorf("list ResourceSlices of node %s: %w", node, err)
	}
	out := SliceIDs{}
	for _, s := range list.Items {
		out[s.Name] = s.UID
	}
	return out, nil
}

// WaitForSlices waits until the node's pool is published completely (every
// slice of its newest generation exists) and returns its slices.
func WaitForSlices(ctx context.Context, client kubernetes.Interface, node string, timeout time.Duration) (SliceIDs, error) {
	var ids SliceIDs
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		list, err := client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{
			FieldSelector: "spec.driver=" + DriverName + ",spec.nodeName=" + node,
		})
		if err != nil || len(list.Items) == 0 {
			return false, nil
		}
		var gen int64
		for _, s := range list.Items {
			gen = max(gen, s.Spec.Pool.Generation)
		}
		ids = SliceIDs{}
		var want int64
		for _, s := range list.Items {
			if s.Spec.Pool.Generation == gen {
				ids[s.Name] = s.UID
				want = s.Spec.Pool.ResourceSliceCount
			}
		}
		return int64(len(ids)) == want, nil
	})
	if err != nil {
		return nil, fmt.Errorf("ResourceSlices of node %s not published within %v: %w", node, timeout, err)
	}
	return ids, nil
}
