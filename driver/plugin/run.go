package plugin

import (
	"context"
	"fmt"

	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2"

	"github.com/tessera-dev/tessera/cdi"
	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/devnodes"
	"github.com/tessera-dev/tessera/driver/discovery"
	"github.com/tessera-dev/tessera/driver/prepare"
	"github.com/tessera-dev/tessera/driver/slices"
)

// Plugin is a running kubelet plugin.
type Plugin struct {
	helper *kubeletplugin.Helper
	driver *Driver
	ctx    context.Context
}

// Start discovers the node, recovers prepared state, registers with the
// kubelet and publishes the node's devices. The plugin runs until ctx ends or
// Stop is called.
func Start(ctx context.Context, o Options, client kubernetes.Interface) (*Plugin, error) {
	logger := klog.FromContext(ctx)
	node, err := o.Node.Open()
	if err != nil {
		return nil, err
	}
	gpus, err := discovery.Discover(ctx, node)
	if err != nil {
		return nil, fmt.Errorf("discover GPUs: %w", err)
	}
	logger.Info("Discovered GPUs", "count", len(gpus), "profile", node.Profile, "driverRoot", node.DriverRoot)
	resources, err := slices.Build(o.Node.NodeName, gpus)
	if err != nil {
		return nil, err
	}
	cdiStore, err := cdi.NewStore(o.CDIRoot)
	if err != nil {
		return nil, err
	}
	ckpt, err := checkpoint.NewStore(o.PluginDataDir)
	if err != nil {
		return nil, err
	}
	bootID, err := checkpoint.BootID(o.BootIDFile)
	if err != nil {
		return nil, err
	}
	dev, err := devnodes.New(node.DevRoot(), node.HostRoot)
	if err != nil {
		return nil, err
	}
	driverFiles, err := cdi.FindDriverFiles(node.DriverRoot)
	if err != nil {
		return nil, err
	}
	mgr, err := prepare.New(ctx, prepare.Config{
		DriverName: slices.DriverName, PoolName: o.Node.NodeName, GPUs: gpus,
		CDI: cdiStore, Checkpoint: ckpt, DevNodes: dev, DriverFiles: driverFiles, BootID: bootID,
	})
	if err != nil {
		return nil, fmt.Errorf("recover prepared claims: %w", err)
	}
	ctx, cancel := context.WithCancelCause(ctx)
	d := &Driver{claims: mgr, fatal: cancel}
	opts := []kubeletplugin.Option{
		kubeletplugin.DriverName(slices.DriverName),
		kubeletplugin.NodeName(o.Node.NodeName),
		kubeletplugin.KubeClient(client),
		kubeletplugin.RegistrarDirectoryPath(o.RegistrarDir),
		kubeletplugin.PluginDataDirectoryPath(o.PluginDataDir),
		// The state machine locks per claim; serialising every call behind
		// one lock would make independent pods wait for each other.
		kubeletplugin.Serialize(false),
	}
	if o.PodUID != "" {
		opts = append(opts, kubeletplugin.RollingUpdate(types.UID(o.PodUID)))
	}
	helper, err := kubeletplugin.Start(ctx, d, opts...)
	if err != nil {
		cancel(err)
		return nil, fmt.Errorf("start kubelet plugin: %w", err)
	}
	// Publishing waits for the API server; registration with the kubelet and
	// unprepares of recorded claims must not, so it runs in the background.
	go func() {
		if err := helper.PublishResources(ctx, resources); err != nil && ctx.Err() == nil {
			d.HandleError(ctx, fmt.Errorf("publish resource slices: %w", err), "Publishing failed")
		}
	}()
	logger.Info("Kubelet plugin started", "node", o.Node.NodeName, "devices", len(gpus), "registrarDir", o.RegistrarDir, "pluginDataDir", o.PluginDataDir)
	return &Plugin{helper: helper, driver: d, ctx: ctx}, nil
}

// Done is closed when the plugin stops on its own (an unrecoverable error)
// or its context ends; Err then says why.
func (p *Plugin) Done() <-chan struct{} { return p.ctx.Done() }

// Err is why the plugin stopped.
func (p *Plugin) Err() error { return context.Cause(p.ctx) }

// Stop unregisters from the kubelet and closes the sockets.
func (p *Plugin) Stop() { p.helper.Stop() }

// Manager exposes the claim state, for tests and diagnostics.
func (p *Plugin) Manager() *prepare.Manager { return p.driver.claims }

// Helper exposes the kubeletplugin helper (registration status, publishing).
func (p *Plugin) Helper() *kubeletplugin.Helper { return p.helper }

// NewClient builds an API client with the options' credentials and rate limits.
func NewClient(o Options) (kubernetes.Interface, error) {
	var cfg *rest.Config
	var err error
	if o.Kubeconfig != "" {
		cfg, err = clientcmd.BuildConfigFromFlags("", o.Kubeconfig)
	} else {
		cfg, err = rest.InClusterConfig()
	}
	if err != nil {
		return nil, fmt.Errorf("load API client configuration (set --kubeconfig outside a cluster): %w", err)
	}
	cfg.QPS, cfg.Burst = o.KubeAPIQPS, o.KubeAPIBurst
	cfg.UserAgent = "tessera-kubelet-plugin"
	return kubernetes.NewForConfig(cfg)
}
