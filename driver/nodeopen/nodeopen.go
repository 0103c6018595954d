// Package nodeopen decides, once at start-up, which NVML a process talks to:
// the real library, or a simulated node when --fake-node asks for one. Both the
// kubelet plugin and the tessera CLI open their node here, with the same flags.
package nodeopen

import (
	"fmt"
	"github.com/tessera-dev/tessera/component"
	"os"
	"path/filepath"

	"github.com/spf13/pflag"

	"github.com/tessera-dev/tessera/driver/fakenode"
	"github.com/tessera-dev/tessera/driver/gpulib"
)

// Options select and locate the node's GPUs.
type Options struct {
	NodeName   string
	DriverRoot string
	// HostDriverRoot is the driver root's path on the host, where it
	// differs from DriverRoot (gpulib.Node.HostDriverRoot).
	HostDriverRoot string
	// FakeNode names a fakenode profile; empty means real NVML.
	FakeNode string
	// FakeRoot receives a fake node's host files.
	FakeRoot string
	// FakeClique overrides a fake node's NVLink clique (<clusterUUID>.<id>).
	FakeClique string
	// Ephemeral opens a fake node as a freshly booted one, whatever an
	// earlier process left in its directory, and keeps no driver state
	// (fakenode.Options.Persist): for commands that only print, so that
	// what they print never depends on an earlier run. Not a flag.
	Ephemeral bool
	// Opened is a node the caller opened itself (a test that keeps driving
	// its fake node); Open returns it as is. Not a flag.
	Opened *gpulib.Node
}

// AddFlags registers the options, with environment fallbacks for DaemonSets.
func (o *Options) AddFlags(fs *pflag.FlagSet) {
	host, _ := os.Hostname()
	fs.StringVar(&o.NodeName, "node-name", component.Env("NODE_NAME", host), "Name of this node. Environment: NODE_NAME.")
	fs.StringVar(&o.DriverRoot, "driver-root", component.Env("DRIVER_ROOT", "/"), "Root of the NVIDIA driver installation (libraries, tools and possibly device nodes). Environment: DRIVER_ROOT.")
	fs.StringVar(&o.HostDriverRoot, "host-driver-root", component.Env("HOST_DRIVER_ROOT", ""), "The driver root's path on the host, which CDI specs and MPS daemon pods name, when the plugin's container sees it elsewhere (the chart mounts the host's driver root at /driver-root and passes --driver-root=/driver-root). Empty: the same as --driver-root. Environment: HOST_DRIVER_ROOT.")
	fs.StringVar(&o.FakeNode, "fake-node", component.Env("FAKE_NODE", ""), fmt.Sprintf("Simulate a GPU node instead of using NVML; one of: %v. Environment: FAKE_NODE.", fakenode.Profiles()))
	fs.StringVar(&o.FakeRoot, "fake-root", component.Env("FAKE_ROOT", ""), "Directory for a fake node's host files (sysfs, device nodes, driver) and the state its driver keeps across processes (MIG instances, settings), one profile per directory. Default: tessera-fake-<node-name>-<profile> under the system temp dir; the tessera CLI starts from a fresh directory and keeps no state. Environment: FAKE_ROOT.")
	fs.StringVar(&o.FakeClique, "fake-clique", component.Env("FAKE_CLIQUE", ""), "Override a fake node's multi-node NVLink clique as <clusterUUID>.<cliqueID>. Environment: FAKE_CLIQUE.")
}

// Validate reports flag mistakes before anything is opened.
func (o *Options) Validate() error {
	if o.HostDriverRoot != "" && !filepath.IsAbs(o.HostDriverRoot) {
		return fmt.Errorf("--host-driver-root %q: want an absolute path", o.HostDriverRoot)
	}
	if o.NodeName == "" {
		return fmt.Errorf("--node-name is empty and the host name is unknown: set --node-name or NODE_NAME")
	}
	if o.FakeNode != "" {
		if _, err := fakenode.Lookup(o.FakeNode); err != nil {
			return fmt.Errorf("--fake-node: %w", err)
		}
	} else if o.FakeClique != "" {
		return fmt.Errorf("--fake-clique only applies with --fake-node")
	}
	return nil
}

// Open returns the node the options name. Real NVML is used unless a fake
// node was asked for; a missing library is an error, never a silent fake.
func (o *Options) Open() (*gpulib.Node, error) {
	if o.Opened != nil {
		return o.Opened, nil
	}
	if o.FakeNode == "" {
		n, err := gpulib.OpenReal(o.DriverRoot)
		if err != nil {
			return nil, err
		}
		n.HostDriverRoot = o.HostDriverRoot
		return n, nil
	}
	dir := o.FakeRoot
	if dir == "" && o.Ephemeral {
		return nil, fmt.Errorf("fake node %s: an ephemeral node needs a directory of its own (FakeRoot)", o.FakeNode)
	}
	if dir == "" {
		// One directory per node and profile: each simulated node keeps
		// its own driver state, as each real node's driver does.
		dir = filepath.Join(os.TempDir(), "tessera-fake-"+o.NodeName+"-"+o.FakeNode)
	}
	// Unless Ephemeral, the fake driver's MIG state outlives this process,
	// as the kernel driver's does: a plugin started again over the same
	// --fake-root (another pod of the DaemonSet) finds the partitions held.
	n, err := fakenode.New(o.FakeNode, fakenode.Options{Dir: dir, NodeName: o.NodeName, Clique: o.FakeClique, Persist: !o.Ephemeral})
	if err != nil {
		return nil, fmt.Errorf("--fake-root %s: %w", dir, err)
	}
	return &n.Node, nil
}
