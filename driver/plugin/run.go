package plugin

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	resourceapi "k8s.io/api/resource/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	metadatav1beta1 "k8s.io/dynamic-resource-allocation/api/metadata/v1beta1"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"

	"github.com/tessera-dev/tessera/cdi"
	"github.com/tessera-dev/tessera/component"
	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/devicemeta"
	"github.com/tessera-dev/tessera/driver/devnodes"
	"github.com/tessera-dev/tessera/driver/discovery"
	"github.com/tessera-dev/tessera/driver/domain"
	"github.com/tessera-dev/tessera/driver/driverfiles"
	"github.com/tessera-dev/tessera/driver/features"
	"github.com/tessera-dev/tessera/driver/gpuset"
	"github.com/tessera-dev/tessera/driver/health"
	"github.com/tessera-dev/tessera/driver/hostnodes"
	"github.com/tessera-dev/tessera/driver/imex"
	"github.com/tessera-dev/tessera/driver/inventory"
	"github.com/tessera-dev/tessera/driver/lazymig"
	"github.com/tessera-dev/tessera/driver/mig"
	"github.com/tessera-dev/tessera/driver/mps"
	"github.com/tessera-dev/tessera/driver/nodelock"
	"github.com/tessera-dev/tessera/driver/prepare"
	"github.com/tessera-dev/tessera/driver/slices"
	"github.com/tessera-dev/tessera/metricsserver"
)

// Plugin is a running kubelet plugin.
type Plugin struct {
	helper *kubeletplugin.Helper
	driver *Driver
	ctx    context.Context
	// stopHealth ends the health monitor and the republishing; background
	// waits for both.
	stopHealth context.CancelFunc
	background sync.WaitGroup
	metrics    *prometheus.Registry
	// server serves the metrics and liveness; nil when --metrics-address
	// and --health-address are empty.
	server *metricsserver.Server
	// mps runs MPS daemons (with --mps-image) and stops them (always);
	// nil without a namespace.
	mps *mps.Daemons
	// imex is mps for IMEX daemons (--imex-image).
	imex *imex.Daemons
	// registered is closed once the kubelet registered the plugin: the
	// first publish waits for it, at most registrationWait.
	registered       *registration
	registrationWait time.Duration
	clock            clock.Clock // times registrationWait
	// publishInterval is the least time between two slice writes that
	// lazy MIG wakes (prepares, unprepares) cause.
	publishInterval time.Duration
}

// Files the plugin keeps in --plugin-data-dir besides the checkpoint.
const (
	// HealthStateFile keeps the GPUs' fault taints across restarts.
	HealthStateFile = "health.json"
	// LastKnownFile keeps each GPU's last description, so that a GPU lost
	// while the plugin was down is still published (tainted).
	LastKnownFile = "gpus.json"
	// LazyMIGMarkerFile, present, says the node published lazily before;
	// it holds when each withdrawal taint was first seen in the API
	// (driver/plugin/lazy.go).
	LazyMIGMarkerFile = "lazy-mig-published"
)

// Start discovers the node, recovers prepared state, registers with the
// kubelet and publishes the node's devices. The plugin runs until ctx ends or
// Stop is called.
func Start(ctx context.Context, o Options, client kubernetes.Interface) (*Plugin, error) {
	logger := klog.FromContext(ctx)
	node, err := o.Node.Open()
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(o.PluginDataDir, 0o750); err != nil {
		return nil, fmt.Errorf("create --plugin-data-dir: %w", err)
	}
	gates := o.gates()
	// Before discovery writes its file: a plugin ran here before, and
	// may have published (every partition, before lazy publishing).
	ranBefore := false
	for _, f := range []string{LastKnownFile, checkpoint.FileName, LazyMIGMarkerFile} {
		if _, err := os.Stat(filepath.Join(o.PluginDataDir, f)); err == nil {
			ranBefore = true
		}
	}
	gpus, err := discovery.DiscoverWith(ctx, node, discovery.Options{LastKnownPath: filepath.Join(o.PluginDataDir, LastKnownFile)})
	if err != nil {
		return nil, fmt.Errorf("discover GPUs: %w", err)
	}
	if !gates.Enabled(features.DeviceHealth) {
		// Nothing would taint a lost GPU: leave it out rather than publish
		// it as if it worked.
		gpus = withoutLost(logger, gpus)
	}
	logger.Info("Discovered GPUs", "count", len(gpus), "profile", node.Profile, "driverRoot", node.DriverRoot)
	invOpts := inventory.Options{DynamicMIG: gates.Enabled(features.DynamicMIG), Sharing: o.Sharing.For}
	inv := inventory.Build(gpus, invOpts)
	if _, err := slices.Build(o.Node.NodeName, inv, slices.Options{}); err != nil {
		return nil, err
	}
	metrics := prometheus.NewRegistry()
	var monitor *health.Monitor
	if gates.Enabled(features.DeviceHealth) {
		hopts := o.Health
		if hopts.StatePath == "" {
			hopts.StatePath = filepath.Join(o.PluginDataDir, HealthStateFile)
		}
		if hopts.Metrics, err = health.NewMetrics(metrics); err != nil {
			return nil, err
		}
		if monitor, err = health.New(node.NVML, gpus, hopts); err != nil {
			return nil, err
		}
	}
	cdiStore, err := cdi.NewStore(o.CDIRoot)
	if err != nil {
		return nil, err
	}
	ckpt, err := checkpoint.NewStore(o.PluginDataDir)
	if err != nil {
		return nil, err
	}
	if err := observeCheckpointWrites(metrics, ckpt); err != nil {
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
	dev.HostDevRoot = node.OnHost(dev.DevRoot)
	var version string
	if len(gpus) > 0 {
		version = gpus[0].DriverVersion
	}
	driverFiles, err := driverfiles.Find(ctx, driverfiles.Options{Root: node.DriverRoot, HostRoot: node.OnHost(node.DriverRoot), Version: version, Hook: o.CDIHook})
	if err != nil {
		return nil, err
	}
	hostNodes := &hostnodes.Nodes{Dir: filepath.Join(o.PluginDataDir, "device-nodes"), Maker: node.Nodes, DevRoot: dev.DevRoot}
	// In a rolling update the other instance may be serving: the state
	// machine then takes the locks both share (recovery included).
	var shared prepare.SharedLocks
	if o.PodUID != "" {
		shared = nodelock.New(o.PluginDataDir)
	}
	var daemons prepare.MPSDaemons
	mpsDaemons := o.mpsDaemons(client, node.OnHost(node.DriverRoot))
	if mpsDaemons != nil {
		daemons = mpsDaemons
	}
	var imexes prepare.IMEXDaemons
	imexDaemons := o.imexDaemons(client, node.OnHost(node.DriverRoot))
	if imexDaemons != nil {
		imexes = imexDaemons
	}
	domainStore, err := cdi.NewStoreOfClass(o.CDIRoot, domain.CDIClass)
	if err != nil {
		return nil, err
	}
	var meta *devicemeta.Files
	var forget func(namespace, name string, uid types.UID) error
	if gates.Enabled(features.DeviceMetadata) {
		meta = &devicemeta.Files{PluginDataDir: o.PluginDataDir, CDIDir: o.CDIRoot, Driver: slices.DriverName}
		forget = meta.Forget
	}
	mgr, err := prepare.New(ctx, prepare.Config{
		DriverName: slices.DriverName, PoolName: o.Node.NodeName, Inventory: inv, MIG: mig.NewManager(node.NVML),
		CDI: cdiStore, DomainCDI: domainStore, Checkpoint: ckpt, DevNodes: dev, DriverEdits: driverFiles.Edits, BootID: bootID,
		Settings: gpuset.New(node.NVML), MPS: daemons, IMEX: imexes,
		ClaimEnv: domain.MemberEnv, Shared: shared, HostNodes: hostNodes, Forget: forget,
	})
	if err != nil {
		return nil, fmt.Errorf("recover prepared claims: %w", err)
	}
	claimMetrics, err := newClaimMetrics(metrics, mgr)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancelCause(ctx)
	domains := &domain.Preparer{Driver: slices.DriverName, CDI: domainStore, DevNodes: dev, HostNodes: hostNodes, BootID: bootID}
	if err := domains.RemoveEarlierBoots(ctx); err != nil {
		cancel(err)
		return nil, err
	}
	// Every spec left is now a prepared claim's: the device nodes of a
	// claim without one are what a crash left.
	if err := hostNodes.Sweep(ctx, mgr.HasSpec); err != nil {
		cancel(err)
		return nil, err
	}
	// The kubelet plugin helper removes a claim's device metadata when the
	// kubelet unprepares it; what a claim the kubelet forgot, a lost
	// checkpoint or an earlier boot left goes here, before any prepare can
	// run, unless another instance serves the node beside this one.
	if err := sweepMetadata(ctx, meta, mgr, shared != nil); err != nil {
		cancel(err)
		return nil, err
	}
	d := &Driver{claims: mgr, metadata: meta != nil, domains: domains, fatal: cancel, health: monitor, pool: o.Node.NodeName, metrics: claimMetrics, refused: make(chan []string, 1)}
	if gates.Enabled(features.LazyMIG) && invOpts.DynamicMIG {
		d.lazy = newLazyMIG(o.lazyPolicy(), o.clock(), client, o.Node.NodeName, mgr, filepath.Join(o.PluginDataDir, LazyMIGMarkerFile), ranBefore)
	}
	alive := func() error { return context.Cause(ctx) }
	registered := newRegistration()
	server, err := metricsserver.StartProbes(ctx, o.Addresses, metrics, metricsserver.Probes{Alive: alive, Ready: registered.ready})
	if err != nil {
		cancel(err)
		return nil, err
	}
	opts := []kubeletplugin.Option{
		kubeletplugin.DriverName(slices.DriverName),
		kubeletplugin.NodeName(o.Node.NodeName),
		kubeletplugin.KubeClient(client),
		kubeletplugin.RegistrarDirectoryPath(o.RegistrarDir),
		kubeletplugin.PluginDataDirectoryPath(o.PluginDataDir),
		// The state machine locks per claim; serialising every call behind
		// one lock would make independent pods wait for each other, and in
		// a rolling update wait for the slow steps (an MPS daemon's start)
		// of the other instance's calls too. There the state machine takes
		// the node lock both instances share only around each change of
		// the checkpoint, starting from what is on disk (prepare.Config's
		// Shared, driver/nodelock).
		kubeletplugin.Serialize(false),
		kubeletplugin.GRPCInterceptor(registered.interceptor),
	}
	if meta != nil {
		opts = append(opts, kubeletplugin.EnableDeviceMetadata(true, []schema.GroupVersion{metadatav1beta1.SchemeGroupVersion}), kubeletplugin.CDIDirectory(o.CDIRoot))
	}
	if shared != nil {
		opts = append(opts, kubeletplugin.RollingUpdate(types.UID(o.PodUID)))
	}
	helper, err := kubeletplugin.Start(ctx, d, opts...)
	if err != nil {
		cancel(err)
		server.Stop()
		return nil, fmt.Errorf("start kubelet plugin: %w", err)
	}
	p := &Plugin{helper: helper, driver: d, ctx: ctx, metrics: metrics, server: server, mps: mpsDaemons, imex: imexDaemons, registered: registered, registrationWait: o.RegistrationWait, clock: o.clock(), publishInterval: o.migPublishInterval()}
	healthCtx, stopHealth := context.WithCancel(ctx)
	p.stopHealth = stopHealth
	if monitor != nil {
		// Probes every GPU before the first publish: a GPU lost while the
		// plugin was down is tainted in it.
		monitor.Start(healthCtx)
	}
	// Publishing waits for the API server; registration with the kubelet and
	// unprepares of recorded claims must not, so it runs in the background.
	p.background.Add(1)
	go func() {
		defer p.background.Done()
		p.publish(healthCtx, client, o.Node.NodeName, gpus, invOpts, inv, monitor)
	}()
	p.background.Add(1)
	go func() {
		defer p.background.Done()
		p.unprepareStale(healthCtx, client)
	}()
	logger.Info("Kubelet plugin started", "node", o.Node.NodeName, "devices", len(gpus), "deviceHealth", monitor != nil, "registrarDir", o.RegistrarDir, "pluginDataDir", o.PluginDataDir)
	return p, nil
}

// publish publishes the node's devices, again with the new taints each time
// a device's health changes, with static MIG if the API server turns out not
// to serve partitionable devices, and without shared GPUs if it does not
// serve consumable capacity, until ctx ends.
func (p *Plugin) publish(ctx context.Context, client kubernetes.Interface, nodeName string, gpus []discovery.GPU, opts inventory.Options, inv *inventory.Inventory, monitor *health.Monitor) {
	var taints map[string][]resourceapi.DeviceTaint
	first := true
	wait := p.registrationWait
	if wait == 0 {
		wait = DefaultRegistrationWait
	}
	if !p.registered.wait(ctx, p.clock, wait) && ctx.Err() == nil {
		klog.FromContext(ctx).Info("The kubelet has not registered the plugin yet; publishing the node's devices anyway", "waited", wait)
	}
	lazy := p.driver.lazy
	var (
		lazyWake <-chan struct{} // nil without lazy MIG: never ready
		lazyHeld <-chan struct{} // likewise
		next     clock.Timer     // when a withdrawal's grace ends
		nextC    <-chan time.Time
		decided  *lazymig.Decision // the last decision published
		// decidedAt is when the loop last decided what to publish; a
		// change of what the node holds within publishInterval of it
		// waits for paceC, and the changes meanwhile are decided on and
		// published together then: at most one decision and one write
		// per interval for prepares and unprepares, however many. News
		// in the API (another instance's write), health changes and a
		// grace's end are decided on at once.
		decidedAt time.Time
		paceC     <-chan time.Time
		// published is what was last handed to the slice controller,
		// built from built.
		published *resourceslice.DriverResources
		built     buildInputs
	)
	if lazy != nil {
		lazyWake, lazyHeld = lazy.wake, lazy.held
		if err := lazy.watch(ctx); err != nil {
			p.driver.HandleError(ctx, err, "Publishing every MIG partition")
			lazy, lazyWake, lazyHeld = nil, nil, nil
		}
	}
	if lazy != nil {
		defer func() {
			if next != nil {
				next.Stop()
			}
		}()
	}
	publish := func() {
		decidedAt = time.Now()
		bopts := slices.Options{Taints: taints}
		if lazy != nil && lazyMIGApplies(inv) {
			dec, err := lazy.decideFor(ctx, inv, taints)
			switch {
			case err != nil:
				// The last decision stands (every partition before the
				// first): nothing is withdrawn; the health taints are
				// published all the same.
				p.driver.HandleError(ctx, fmt.Errorf("%w: %w", kubeletplugin.ErrRecoverable, err), "Deciding which MIG partitions to publish failed; retrying")
				next, nextC = lazy.after(next, lazyRetry)
			case !dec.Next.IsZero():
				next, nextC = lazy.after(next, dec.Next.Sub(lazy.clock.Now()))
				decided = &dec
			default:
				decided = &dec
			}
			bopts.Lazy = decided
		}
		in := buildInputs{inv: inv, opts: bopts}
		if published != nil && built.same(in) {
			// Nothing Build depends on changed (most prepares' and
			// unprepares' wakes, our own write seen): the slices would
			// be what the controller has.
			return
		}
		res, err := slices.Build(nodeName, inv, bopts)
		if err == nil && first {
			first = false
			if _, perr := prepublish(ctx, client, nodeName, res); perr != nil {
				klog.FromContext(ctx).Info("Publishing through the ResourceSlice controller only", "reason", perr)
			}
		}
		if err == nil && published != nil && apiequality.Semantic.DeepEqual(*published, res) {
			// Unchanged (a prepare's wake, our own write seen): each
			// PublishResources makes the upstream controller sync, and a
			// sync against a cache that has not seen its last write yet
			// writes the same slices again.
			return
		}
		if err == nil {
			err = p.helper.PublishResources(ctx, res)
		}
		if err == nil {
			published, built = &res, in
			p.driver.metrics.publishedDevices(&res)
		}
		if err != nil && ctx.Err() == nil {
			p.driver.HandleError(ctx, fmt.Errorf("publish resource slices: %w", err), "Publishing failed")
		}
	}
	// pace publishes a change of what the node holds now, or, within
	// publishInterval of the last decision, at its end: paced, not dropped,
	// since what it asks for is decided afresh when it is published.
	// Waiting is safe both ways: partitions opened late are only offered
	// late, and a withdrawal is decided (and checked against the claims in
	// the API) when it is written, never before.
	pace := func() {
		if wait := p.publishInterval - time.Since(decidedAt); wait > 0 {
			if paceC == nil {
				paceC = time.After(wait)
			}
			return
		}
		publish()
	}
	var changes <-chan health.Snapshot // stays nil without health: never ready
	if monitor != nil {
		var unsubscribe func()
		changes, unsubscribe = monitor.Subscribe() // delivers the current state first
		defer unsubscribe()
	} else {
		publish()
	}
	for {
		select {
		case <-ctx.Done():
			return
		case s := <-changes:
			taints = s.Taints()
			publish()
		case <-lazyWake:
			if lazy == nil || !lazy.showsOwn(inv) {
				publish() // news in the API: another instance's write, a deletion
				continue
			}
			// Our own write seen: deciding at once would publish the
			// changes of what the node holds since, unpaced.
			pace()
		case <-lazyHeld:
			pace()
		case <-paceC:
			paceC = nil
			publish()
		case <-nextC:
			nextC = nil
			publish()
		case features := <-p.driver.refused:
			if lazy != nil && dropsFields(features, "DRADeviceTaints") {
				// Without device taints a withdrawal could not be
				// announced: publish every partition instead.
				klog.FromContext(ctx).Info("The API server does not serve device taints (DRADeviceTaints): publishing every MIG partition, as with --feature-gates=LazyMIG=false")
				lazy, lazyWake, lazyHeld, nextC, decided = nil, nil, nil, nil, nil
				publish()
			}
			was := opts
			if dropsFields(features, "DRAPartitionableDevices") {
				opts.DynamicMIG = false
			}
			if dropsFields(features, "DRAConsumableCapacity") {
				opts.Sharing = nil
			}
			if opts.DynamicMIG == was.DynamicMIG && (opts.Sharing == nil) == (was.Sharing == nil) {
				continue
			}
			inv = inventory.Build(gpus, opts)
			p.driver.claims.SetInventory(inv)
			publish()
		}
	}
}

// buildInputs are what slices.Build makes a node's slices of, besides the
// node's name.
type buildInputs struct {
	inv  *inventory.Inventory
	opts slices.Options
}

// same says whether Build would make the same slices of in as of b: the
// same inventory, taints and lazy decision (its States and Order; Next is
// not published).
func (b buildInputs) same(in buildInputs) bool {
	if b.inv != in.inv || !apiequality.Semantic.DeepEqual(b.opts.Taints, in.opts.Taints) || (b.opts.Lazy == nil) != (in.opts.Lazy == nil) {
		return false
	}
	if b.opts.Lazy == nil {
		return true
	}
	x, y := b.opts.Lazy, in.opts.Lazy
	if !apiequality.Semantic.DeepEqual(x.Order, y.Order) || len(x.States) != len(y.States) {
		return false
	}
	for g, s := range x.States {
		if t, ok := y.States[g]; !ok || !sameState(s, t) {
			return false
		}
	}
	return true
}

// Done is closed when the plugin stops on its own (an unrecoverable error)
// or its context ends; Err then says why.
func (p *Plugin) Done() <-chan struct{} { return p.ctx.Done() }

// Err is why the plugin stopped.
func (p *Plugin) Err() error { return context.Cause(p.ctx) }

// Stop unregisters from the kubelet, closes the sockets and stops watching
// device health.
func (p *Plugin) Stop() {
	p.stopHealth()
	p.background.Wait()
	if p.driver.health != nil {
		<-p.driver.health.Done()
	}
	p.helper.Stop()
	p.server.Stop()
}

// Driver is the DRA interface the kubelet calls, for tests.
func (p *Plugin) Driver() *Driver { return p.driver }

// Health is the device health monitor; nil when DeviceHealth is off.
func (p *Plugin) Health() *health.Monitor { return p.driver.health }

// Metrics is the registry holding the plugin's Prometheus metrics.
func (p *Plugin) Metrics() *prometheus.Registry { return p.metrics }

// MetricsAddress is the address /metrics is served at (the port chosen when
// --metrics-address asked for port 0); empty when metrics are not served.
func (p *Plugin) MetricsAddress() string {
	if p.server == nil {
		return ""
	}
	return p.server.Addr()
}

// withoutLost drops the GPUs discovery described from their last-known
// description.
func withoutLost(logger klog.Logger, gpus []discovery.GPU) []discovery.GPU {
	out := gpus[:0:0]
	for _, g := range gpus {
		if g.Lost != "" {
			logger.Info("GPU is lost and DeviceHealth is off, so nothing would taint it; not publishing it", "device", g.Name(), "uuid", g.UUID, "reason", g.Lost)
			continue
		}
		out = append(out, g)
	}
	return out
}

// Manager exposes the claim state, for tests and diagnostics.
func (p *Plugin) Manager() *prepare.Manager { return p.driver.claims }

// Helper exposes the kubeletplugin helper (registration status, publishing).
func (p *Plugin) Helper() *kubeletplugin.Helper { return p.helper }

// NewClient builds an API client with the options' credentials, rate limits
// and request deadline (--kube-api-timeout).
func NewClient(o Options) (kubernetes.Interface, error) {
	cfg, err := component.RESTConfig(o.Kubeconfig, o.KubeAPIQPS, o.KubeAPIBurst, "tessera-kubelet-plugin", o.apiTimeout())
	if err != nil {
		return nil, err
	}
	return kubernetes.NewForConfig(cfg)
}
