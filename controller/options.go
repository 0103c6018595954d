package controller

import (
	"fmt"
	"os"
	"strconv"
	"time"

	"github.com/spf13/pflag"

	"github.com/tessera-dev/tessera/component"
	"github.com/tessera-dev/tessera/metricsserver"
)

// DefaultKubeAPITimeout is the API server's own limit for a request
// (kube-apiserver --request-timeout, 60 s by default): the controller's
// informers list every pod, claim and slice of the cluster, which on a large
// cluster takes long, and a request the server still answers must not be
// cut. A server that answers nothing fails the request after it, and
// client-go's informers and the gang controller's queue retry.
const DefaultKubeAPITimeout = 60 * time.Second

// Options are tessera-controller's settings.
type Options struct {
	Kubeconfig   string
	KubeAPIQPS   float32
	KubeAPIBurst int
	// KubeAPITimeout bounds each request to the API server
	// (component.Deadline); zero means DefaultKubeAPITimeout, which says
	// why.
	KubeAPITimeout time.Duration

	// TopologyKey is a node label whose values are domains (e.g. a rack
	// label), for clusters without multi-node NVLink; empty for none.
	TopologyKey string
	// Channels is how many channel devices each domain offers: how many
	// gangs with a domain claim can share one domain at once.
	Channels int
	// UnschedulableGrace is how long a released member may stay
	// unschedulable on the node it was placed on before the gang is rolled
	// back and placed again.
	UnschedulableGrace time.Duration
	// NodeLabels labels GPU nodes with their NVLink domain and clique
	// (controller/nodelabels).
	NodeLabels bool
	// IMEXDaemons: the kubelet plugins run IMEX daemons; report them on
	// the gangs (gang.Options.IMEXDaemons).
	IMEXDaemons bool
	// DaemonNamespace is the kubelet plugins' namespace (their IMEX
	// daemon pods').
	DaemonNamespace string
	// NoReservations: waiting gangs reserve nothing (--gang-reservations=false;
	// gang.Options.NoReservations).
	NoReservations bool

	// Addresses are where /metrics and /healthz are served
	// (--metrics-address, --health-address).
	metricsserver.Addresses

	// LeaderElect runs the controller only while it holds the Lease
	// LeaseNamespace/LeaseName.
	LeaderElect    bool
	LeaseNamespace string
	LeaseName      string
	LeaseDuration  time.Duration
	RenewDeadline  time.Duration
	RetryPeriod    time.Duration

	// Interrupt, for tests only (no flag), stops a placement at a step as
	// a crash would (gang.Options.Interrupt).
	Interrupt func(step string) bool
}

// AddFlags registers the options.
func (o *Options) AddFlags(fs *pflag.FlagSet) {
	fs.StringVar(&o.Kubeconfig, "kubeconfig", os.Getenv("KUBECONFIG"), "Path to a kubeconfig; empty means the in-cluster service account. Environment: KUBECONFIG.")
	fs.Float32Var(&o.KubeAPIQPS, "kube-api-qps", 200, "Queries per second to the API server. Placing a gang writes two requests per claim and one per pod: keep this high enough for the largest gang.")
	fs.IntVar(&o.KubeAPIBurst, "kube-api-burst", 400, "Burst of queries to the API server.")
	fs.DurationVar(&o.KubeAPITimeout, "kube-api-timeout", DefaultKubeAPITimeout, "How long a request to the API server may go unanswered (a watch: until its first response) before it fails and is retried. The default is the API server's own limit for a request, so that lists of a large cluster are not cut.")
	fs.StringVar(&o.TopologyKey, "topology-key", "", "Node label whose values are gang domains (e.g. a rack label such as topology.kubernetes.io/rack), besides the NVLink cliques; empty for cliques only.")
	fs.IntVar(&o.Channels, "domain-channels", 8, "Channel devices per domain: how many gangs with a domain claim can share one domain at once.")
	fs.DurationVar(&o.UnschedulableGrace, "unschedulable-grace", time.Minute, "How long a released gang member may stay unschedulable on the node it was placed on (another pod took the room meanwhile), or bound there but not started while a device of its claims is allocated to another claim too, before the gang is evicted and placed again.")
	o.Addresses.AddFlags(fs)
	fs.Var(invertedBool{&o.NoReservations}, "gang-reservations", "A gang that must wait for pods to end reserves the nodes that free up first (NoSchedule DeviceTaintRules; backfill pods tolerate them). false: waiting gangs reserve nothing, and small pods may keep taking what frees up. Default true.")
	fs.BoolVar(&o.NodeLabels, "node-labels", true, "Label each GPU node with the NVLink domain and clique its GPUs publish (gpu.tessera.dev/nvlink-domain, gpu.tessera.dev/nvlink-clique), for PodGroup topology constraints, topology spread and affinity; the chart's admission policy lets the controller change no other part of a Node.")
	fs.BoolVar(&o.IMEXDaemons, "imex-daemons", false, "The kubelet plugins run IMEX daemons for gang domain claims on NVLink domains (their --imex-image is set): report the daemons' readiness on each gang placed in an NVLink domain (condition IMEXReady).")
	fs.StringVar(&o.DaemonNamespace, "daemon-namespace", component.Env("POD_NAMESPACE", "tessera-system"), "Namespace of the kubelet plugins, where their IMEX daemon pods run (the chart installs both in its release namespace); pods labelled as daemons elsewhere are ignored. Environment: POD_NAMESPACE.")
	fs.BoolVar(&o.LeaderElect, "leader-elect", true, "Run only while holding the leader Lease, so that replicas of the Deployment never place gangs at once.")
	fs.StringVar(&o.LeaseNamespace, "leader-elect-namespace", component.Env("POD_NAMESPACE", "tessera-system"), "Namespace of the leader Lease. Environment: POD_NAMESPACE.")
	fs.StringVar(&o.LeaseName, "leader-elect-name", "tessera-controller", "Name of the leader Lease.")
	fs.DurationVar(&o.LeaseDuration, "leader-elect-lease-duration", 15*time.Second, "How long a leader's Lease lasts without renewal: how long a crashed leader's successor waits.")
	fs.DurationVar(&o.RenewDeadline, "leader-elect-renew-deadline", 10*time.Second, "How long the leader retries renewing before it gives up leading.")
	fs.DurationVar(&o.RetryPeriod, "leader-elect-retry-period", 2*time.Second, "How often candidates try to take the Lease.")
}

// Validate checks the options before anything starts.
func (o *Options) Validate() error {
	if o.Channels < 1 {
		return fmt.Errorf("--domain-channels %d: want at least 1", o.Channels)
	}
	if o.UnschedulableGrace <= 0 {
		return fmt.Errorf("--unschedulable-grace %v: want a positive duration", o.UnschedulableGrace)
	}
	if o.KubeAPIQPS <= 0 || o.KubeAPIBurst <= 0 {
		return fmt.Errorf("--kube-api-qps and --kube-api-burst must be positive")
	}
	if o.KubeAPITimeout < 0 {
		return fmt.Errorf("--kube-api-timeout %v: want a positive duration", o.KubeAPITimeout)
	}
	if err := o.Addresses.Validate(); err != nil {
		return err
	}
	if o.LeaderElect && (o.LeaseNamespace == "" || o.LeaseName == "") {
		return fmt.Errorf("--leader-elect needs --leader-elect-namespace and --leader-elect-name")
	}
	if o.LeaderElect && !(o.LeaseDuration > o.RenewDeadline && o.RenewDeadline > o.RetryPeriod && o.RetryPeriod > 0) {
		return fmt.Errorf("leader election: want lease duration > renew deadline > retry period > 0, got %v, %v, %v", o.LeaseDuration, o.RenewDeadline, o.RetryPeriod)
	}
	return nil
}

// apiTimeout is the deadline of each request to the API server.
func (o *Options) apiTimeout() time.Duration {
	if o.KubeAPITimeout == 0 {
		return DefaultKubeAPITimeout
	}
	return o.KubeAPITimeout
}

// invertedBool is a boolean flag stored negated, so that an Options left
// zero means the flag's default (true).
type invertedBool struct{ no *bool }

func (b invertedBool) String() string {
	if b.no == nil {
		return "true"
	}
	return strconv.FormatBool(!*b.no)
}

func (b invertedBool) Set(s string) error {
	v, err := strconv.ParseBool(s)
	if err != nil {
		return err
	}
	*b.no = !v
	return nil
}

func (b invertedBool) Type() string { return "bool" }

// IsBoolFlag lets --gang-reservations stand alone for true.
func (b invertedBool) IsBoolFlag() bool { return true }
