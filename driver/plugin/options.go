package plugin

import (
	"fmt"
	"path/filepath"
	"time"

	"github.com/spf13/pflag"
	"k8s.io/client-go/kubernetes"
	"k8s.io/component-base/featuregate"
	"k8s.io/utils/clock"

	"github.com/tessera-dev/tessera/component"
	"github.com/tessera-dev/tessera/driver/daemonpod"
	"github.com/tessera-dev/tessera/driver/features"
	"github.com/tessera-dev/tessera/driver/health"
	"github.com/tessera-dev/tessera/driver/imex"
	"github.com/tessera-dev/tessera/driver/lazymig"
	"github.com/tessera-dev/tessera/driver/mps"
	"github.com/tessera-dev/tessera/driver/nodeopen"
	"github.com/tessera-dev/tessera/driver/sharing"
	"github.com/tessera-dev/tessera/driver/slices"
	"github.com/tessera-dev/tessera/metricsserver"
)

// DefaultKubeAPITimeout bounds each request of the plugin to the API
// server. The kubelet gives a prepare 45 s, and a prepare may wait for
// several requests (kubeletplugin reads the claims; an MPS daemon's pod is
// created and read): 10 s each leaves the kubelet's retry its time. What
// the plugin asks is small (one claim, its own node's slices and daemon
// pods), so 10 s is long even for a loaded API server.
const DefaultKubeAPITimeout = 10 * time.Second

// Lazy MIG publishing's defaults (--mig-spare-gpus, --mig-withdraw-grace;
// lazymig.DefaultPolicy says why).
var (
	DefaultMIGSpareGPUs     = lazymig.DefaultPolicy.Spares
	DefaultMIGWithdrawGrace = lazymig.DefaultPolicy.Grace
	// DefaultMIGPublishInterval bounds the slice writes prepares and
	// unprepares cause to one a second per node: a burst of pod starts
	// and ends (tens a second on a busy node) then costs the API server
	// one write of the node's slices, not one or two per pod.
	DefaultMIGPublishInterval = time.Second
)

// Options are the kubelet plugin's settings, from flags with environment
// fallbacks for the DaemonSet.
type Options struct {
	Node nodeopen.Options

	Kubeconfig   string
	KubeAPIQPS   float32
	KubeAPIBurst int
	// KubeAPITimeout bounds each request to the API server
	// (component.Deadline); zero means DefaultKubeAPITimeout, which says
	// why.
	KubeAPITimeout time.Duration

	CDIRoot       string
	PluginDataDir string
	RegistrarDir  string
	BootIDFile    string
	// PodUID enables the kubelet's rolling-update mode (two plugin pods
	// serving side by side during a DaemonSet update).
	PodUID string
	// Addresses are where /metrics and /healthz are served
	// (--metrics-address, --health-address).
	metricsserver.Addresses

	// TimeSlicedGPUs and MemorySharedGPUs choose the GPUs independent
	// claims share (package sharing); Sharing is what they parse to.
	TimeSlicedGPUs   string
	MemorySharedGPUs string
	Sharing          sharing.Policy
	// Namespace is the plugin's namespace, where it runs MPS control
	// daemons; MPSImage is the image they run (it needs no NVIDIA files:
	// the driver's MPS binaries are mounted from the driver root).
	Namespace string
	MPSImage  string
	// IMEXImage is the image of the IMEX daemon pods (the daemon comes
	// from the driver root); empty runs none. IMEXPort is their TCP port.
	IMEXImage string
	IMEXPort  int
	// CDIHook is the host path of tessera-cdi-hook, which the CDI specs
	// run to update the containers' loader cache; empty leaves it out.
	CDIHook string
	// RegistrationWait bounds how long the first publish waits for the
	// kubelet's registration (registration.go); zero means
	// DefaultRegistrationWait. Not a flag.
	RegistrationWait time.Duration

	// Health tunes device health monitoring (feature gate DeviceHealth).
	Health health.Options
	// MIGSpareGPUs and MIGWithdrawGrace tune lazy MIG publishing (feature
	// gate LazyMIG, driver/lazymig).
	MIGSpareGPUs     int
	MIGWithdrawGrace time.Duration
	// MIGPublishInterval is the least time between two writes of the
	// node's slices that prepares and unprepares cause under lazy MIG
	// publishing; zero means DefaultMIGPublishInterval.
	MIGPublishInterval time.Duration
	// Clock times lazy MIG publishing's withdrawals and the first
	// publish's wait for the kubelet's registration; nil means the real
	// clock. Not a flag.
	Clock clock.WithTicker
	// FeatureGates are Tessera's gates (package features); nil means all at
	// their defaults.
	FeatureGates featuregate.MutableFeatureGate
}

// AddFlags registers the options.
func (o *Options) AddFlags(fs *pflag.FlagSet) {
	o.Node.AddFlags(fs)
	fs.StringVar(&o.Kubeconfig, "kubeconfig", component.Env("KUBECONFIG", ""), "Path to a kubeconfig; empty means the in-cluster service account. Environment: KUBECONFIG.")
	fs.Float32Var(&o.KubeAPIQPS, "kube-api-qps", 50, "Queries per second to the API server. Prepares read claims from it, so keep this above the expected prepare rate.")
	fs.IntVar(&o.KubeAPIBurst, "kube-api-burst", 100, "Burst of queries to the API server.")
	fs.DurationVar(&o.KubeAPITimeout, "kube-api-timeout", DefaultKubeAPITimeout, "How long a request to the API server may go unanswered (a watch: until its first response) before it fails. Prepares read claims from the API server within the kubelet's 45 s.")
	fs.StringVar(&o.CDIRoot, "cdi-root", component.Env("CDI_ROOT", "/var/run/cdi"), "Directory the container runtime reads CDI specs from. Environment: CDI_ROOT.")
	fs.StringVar(&o.PluginDataDir, "plugin-data-dir", component.Env("PLUGIN_DATA_DIR", filepath.Join("/var/lib/kubelet/plugins", slices.DriverName)), "Directory for the plugin's socket, checkpoint, GPU health state (health.json) and last-known GPU descriptions (gpus.json). Environment: PLUGIN_DATA_DIR.")
	fs.StringVar(&o.RegistrarDir, "registrar-dir", component.Env("REGISTRAR_DIR", "/var/lib/kubelet/plugins_registry"), "The kubelet's plugin registration directory. Environment: REGISTRAR_DIR.")
	fs.StringVar(&o.BootIDFile, "boot-id-file", component.Env("BOOT_ID_FILE", "/proc/sys/kernel/random/boot_id"), "File holding the kernel's boot ID; prepared state from an earlier boot is discarded. Environment: BOOT_ID_FILE.")
	fs.StringVar(&o.TimeSlicedGPUs, "time-sliced-gpus", component.Env("TIME_SLICED_GPUS", ""), "GPUs that independent claims share by time-slicing, each cut into N slices the scheduler hands out one per claim (never more than N): comma-separated SELECTOR=N, SELECTOR being all, a GPU index or a GPU UUID (e.g. all=4 or 0=2,1=8). Shared GPUs are offered whole only, not as MIG partitions. Environment: TIME_SLICED_GPUS.")
	fs.StringVar(&o.MemorySharedGPUs, "memory-shared-gpus", component.Env("MEMORY_SHARED_GPUS", ""), "GPUs that independent claims share by memory: each claim asks for an amount (capacity.requests.memory, in whole GiB) and the scheduler never hands out more than the GPU has; comma-separated selectors (all, GPU indexes, GPU UUIDs). Environment: MEMORY_SHARED_GPUS.")
	fs.StringVar(&o.Namespace, "namespace", component.Env("POD_NAMESPACE", "tessera-system"), "The plugin's namespace, where it runs MPS control daemons. Environment: POD_NAMESPACE.")
	fs.StringVar(&o.MPSImage, "mps-image", component.Env("MPS_IMAGE", ""), "Image of the MPS control daemon pods; its entrypoint is not used (the daemon binary comes from the driver root). Empty: the plugin's own image is not known, MPS claims are refused (daemons started before still stop when their claims are unprepared). Environment: MPS_IMAGE.")
	fs.StringVar(&o.IMEXImage, "imex-image", component.Env("IMEX_IMAGE", ""), "Image of the IMEX daemon pods the plugin runs for gang domain claims on multi-node NVLink domains (GB200 NVL72), one per claim on each node of the gang, configured with exactly the gang's nodes; its entrypoint is not used (nvidia-imex comes from the driver root). Empty: no IMEX daemons; run nvidia-imex on the gang's nodes yourself or multi-node CUDA memory sharing fails (daemons started before still stop when their claims are unprepared). Environment: IMEX_IMAGE.")
	fs.IntVar(&o.IMEXPort, "imex-port", 50000, "TCP port of the IMEX daemons (their SERVER_PORT), on the node's InternalIP; the same on every node.")
	fs.StringVar(&o.CDIHook, "cdi-hook", component.Env("CDI_HOOK", ""), "Host path of tessera-cdi-hook (the chart installs it under the plugin's data directory), which every claim's CDI spec runs as a createContainer hook to link the driver's libraries and add them to the container's loader cache. Empty: no hook, and containers whose image loads libraries from other directories than the driver's cannot find libcuda. Environment: CDI_HOOK.")
	fs.IntVar(&o.MIGSpareGPUs, "mig-spare-gpus", DefaultMIGSpareGPUs, "With LazyMIG: how many free GPUs' MIG partitions each node publishes besides those of the GPUs already partitioned (0 means the default). A claim whose partitions must span more GPUs than are partitioned or spare cannot be allocated on the node; raise this for such claims (8 publishes every partition).")
	fs.DurationVar(&o.MIGPublishInterval, "mig-publish-interval", DefaultMIGPublishInterval, "With LazyMIG: the least time between two writes of the node's ResourceSlices that prepares and unprepares cause (a partitioned GPU opening the next spare, a freed one closing). Changes within it are published together in one write at its end; the first change after a quiet spell is published at once, and health changes always are. Delaying a write only delays what the scheduler may allocate: a withdrawal is still decided, and checked against the claims, when it is written (0 means the default).")
	fs.DurationVar(&o.MIGWithdrawGrace, "mig-withdraw-grace", DefaultMIGWithdrawGrace, "With LazyMIG: how long a freed GPU's partitions stay published under a NoSchedule taint before they are withdrawn. It must outlast the longest wait between the scheduler choosing a partition and writing the allocation (a Permit wait: the GangScheduling plugin's is 5 minutes; kube-scheduler v1.37 writes allocations beside VolumeBinding's PreBind, so a volume's wait does not delay it): an allocation chosen before the taint and written after the withdrawal would hold a partition the scheduler no longer counts. Partitions under the taint cannot be allocated, whatever taints a claim tolerates.")
	o.Health.AddFlags(fs)
	if o.FeatureGates == nil {
		o.FeatureGates = features.New()
	}
	o.FeatureGates.AddFlag(fs)
	o.Addresses.AddFlags(fs)
	fs.StringVar(&o.PodUID, "pod-uid", component.Env("POD_UID", ""), "UID of the plugin's pod (downward API); enables the kubelet's rolling-update mode: two instances serve side by side; each change of the node's prepared state is serialised across them by a file lock and starts from the checkpoint on disk. Environment: POD_UID.")
}

// Validate checks the options before anything starts.
func (o *Options) Validate() error {
	if err := o.Node.Validate(); err != nil {
		return err
	}
	for flag, dir := range map[string]string{"--cdi-root": o.CDIRoot, "--plugin-data-dir": o.PluginDataDir, "--registrar-dir": o.RegistrarDir} {
		if dir == "" || !filepath.IsAbs(dir) {
			return fmt.Errorf("%s %q: want an absolute directory path", flag, dir)
		}
	}
	if err := o.Addresses.Validate(); err != nil {
		return err
	}
	if err := o.Sharing.ParseTimeSliced(o.TimeSlicedGPUs); err != nil {
		return err
	}
	if err := o.Sharing.ParseMemoryShared(o.MemorySharedGPUs); err != nil {
		return err
	}
	if o.CDIHook != "" && !filepath.IsAbs(o.CDIHook) {
		return fmt.Errorf("--cdi-hook %q: want the hook's absolute path on the host", o.CDIHook)
	}
	if o.MPSImage != "" && o.Namespace == "" {
		return fmt.Errorf("--mps-image needs --namespace (the plugin's namespace, where MPS daemon pods run)")
	}
	if o.IMEXImage != "" && o.Namespace == "" {
		return fmt.Errorf("--imex-image needs --namespace (the plugin's namespace, where IMEX daemon pods run)")
	}
	if o.IMEXPort < 0 || o.IMEXPort > 65535 {
		return fmt.Errorf("--imex-port %d: want a TCP port, 1 to 65535", o.IMEXPort)
	}
	if o.KubeAPIQPS <= 0 || o.KubeAPIBurst <= 0 {
		return fmt.Errorf("--kube-api-qps and --kube-api-burst must be positive")
	}
	if o.MIGSpareGPUs < 0 {
		return fmt.Errorf("--mig-spare-gpus %d: want 0 or more free GPUs whose partitions each node publishes", o.MIGSpareGPUs)
	}
	if o.MIGPublishInterval < 0 {
		return fmt.Errorf("--mig-publish-interval %v: want a positive duration (0 means the default, %v)", o.MIGPublishInterval, DefaultMIGPublishInterval)
	}
	if o.MIGWithdrawGrace < 0 {
		return fmt.Errorf("--mig-withdraw-grace %v: want a positive duration, longer than the scheduler's binding cycle", o.MIGWithdrawGrace)
	}
	if o.KubeAPITimeout < 0 {
		return fmt.Errorf("--kube-api-timeout %v: want a positive duration", o.KubeAPITimeout)
	}
	return o.Health.Validate()
}

// gates returns the feature gates, defaults when none were set.
func (o *Options) gates() featuregate.FeatureGate {
	if o.FeatureGates == nil {
		return features.New()
	}
	return o.FeatureGates
}

// mpsDaemons runs MPS daemons as pods in the plugin's namespace. Without
// --mps-image it runs none (MPS claims are refused) but still stops those
// an earlier configuration started, at unprepare and in the daemon sweep;
// nil only without a namespace, where none can have run.
func (o *Options) mpsDaemons(client kubernetes.Interface, driverRoot string) *mps.Daemons {
	if o.Namespace == "" {
		return nil
	}
	return &mps.Daemons{Host: daemonpod.Host{Client: client, Namespace: o.Namespace, NodeName: o.Node.NodeName, Image: o.MPSImage, Dir: filepath.Join(o.PluginDataDir, "mps"), DriverRoot: driverRoot}}
}

// imexDaemons runs IMEX daemons as pods in the plugin's namespace. Without
// --imex-image it runs none (the chart's kubeletPlugin.imex.enabled false)
// but, like mpsDaemons, still stops those that ran before.
func (o *Options) imexDaemons(client kubernetes.Interface, driverRoot string) *imex.Daemons {
	if o.Namespace == "" {
		return nil
	}
	return &imex.Daemons{Host: daemonpod.Host{Client: client, Namespace: o.Namespace, NodeName: o.Node.NodeName, Image: o.IMEXImage, Dir: filepath.Join(o.PluginDataDir, "imex"), DriverRoot: driverRoot}, Port: o.IMEXPort}
}

// lazyPolicy is lazy MIG publishing's policy, defaults for what is unset.
func (o *Options) lazyPolicy() lazymig.Policy {
	p := lazymig.Policy{Spares: o.MIGSpareGPUs, Grace: o.MIGWithdrawGrace}
	if p.Spares == 0 {
		p.Spares = DefaultMIGSpareGPUs
	}
	if p.Grace == 0 {
		p.Grace = DefaultMIGWithdrawGrace
	}
	return p
}

// clock is Clock, or the real clock.
func (o *Options) clock() clock.WithTicker {
	if o.Clock != nil {
		return o.Clock
	}
	return clock.RealClock{}
}

// migPublishInterval is MIGPublishInterval, its default if unset.
func (o *Options) migPublishInterval() time.Duration {
	if o.MIGPublishInterval == 0 {
		return DefaultMIGPublishInterval
	}
	return o.MIGPublishInterval
}

// apiTimeout is the deadline of each request to the API server.
func (o *Options) apiTimeout() time.Duration {
	if o.KubeAPITimeout == 0 {
		return DefaultKubeAPITimeout
	}
	return o.KubeAPITimeout
}
