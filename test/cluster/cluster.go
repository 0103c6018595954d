package cluster

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"

	"github.com/tessera-dev/tessera/test/ociimage"
)

// Options say where a cluster lives and which nodes it has.
type Options struct {
	// Dir holds everything the cluster writes: certificates, kubeconfigs,
	// etcd data, logs (Dir/logs) and one directory per node. It is created
	// if missing and not removed by Stop. Keep it short (for example from
	// os.MkdirTemp("", "tessera-")): unix socket paths below it must stay
	// under 108 bytes.
	Dir string
	// Nodes are the simulated nodes, each a kubelet with a fake runtime.
	Nodes []NodeSpec
	// SchedulerAPIQPS and SchedulerAPIBurst are kube-scheduler's client rate
	// limits (--kube-api-qps, --kube-api-burst); zero keeps 200 and 400.
	// Benchmarks of the scheduler raise them so that the limiter does not
	// set the pace.
	SchedulerAPIQPS, SchedulerAPIBurst int
	// CompositePodGroups makes the cluster serve Kubernetes 1.37's
	// CompositePodGroups (scheduling.k8s.io/v1alpha3): the alpha
	// CompositePodGroup gate and the TopologyAwareWorkloadScheduling gate it
	// needs are on in every component, kubelets included. Off by default:
	// alpha gates change the scheduler, and the configuration users run
	// has them off.
	CompositePodGroups bool
}

// Cluster is a running local cluster. Stop it when done.
type Cluster struct {
	dir    string
	logger klog.Logger
	// gates are the feature gates every component runs with.
	gates map[string]bool
	bins  Binaries
	ca    *certAuthority

	server          string // https://127.0.0.1:<port>
	adminKubeconfig string
	restConfig      *rest.Config
	client          kubernetes.Interface

	components []*process // control plane, in start order
	scheduler  *process
	schedPort  int
	nodes      []*Node
	stopOnce   sync.Once

	// For real-runtime nodes: their binaries, and the archive of the
	// images each imports, built once per cluster.
	runtimeBins     RuntimeBinaries
	nodeImagesOnce  sync.Once
	nodeImagesPath  string
	nodeImagesError error
	pods            *podNetwork // nil without real-runtime nodes
	realNodes       int         // real-runtime nodes created so far
}

// Start brings up etcd, the control plane and every node, and returns once
// all nodes are Ready and the default service account exists. On error
// everything already started is stopped again. Clusters of one process
// start one at a time (starting), each once the machine has room for its
// inotify instances (waitForInotify).
func Start(ctx context.Context, opts Options) (*Cluster, error) {
	start := time.Now()
	if err := CheckPrerequisites(); err != nil {
		return nil, fmt.Errorf("this machine cannot run a local cluster:\n%w", err)
	}
	if err := validate(&opts); err != nil {
		return nil, err
	}
	bins, err := FindBinaries()
	if err != nil {
		return nil, err
	}
	c := &Cluster{dir: opts.Dir, logger: klog.FromContext(ctx), bins: bins, gates: featureGates(opts)}
	if slices.ContainsFunc(opts.Nodes, func(n NodeSpec) bool { return n.Runtime == RealContainerd }) {
		if c.runtimeBins, err = FindRuntimeBinaries(); err != nil {
			return nil, err
		}
	}
	register(c)
	starting.Lock()
	if err = waitForInotify(ctx, inotifyNeeded(opts)); err == nil {
		waited := time.Since(start)
		err = c.start(ctx, opts)
		c.logger.V(2).Info("Waited to start", "dir", c.dir, "duration", waited.Round(time.Millisecond))
	}
	starting.Unlock()
	if err != nil {
		c.Stop()
		return nil, fmt.Errorf("start cluster in %s: %w", opts.Dir, err)
	}
	c.logger.Info("Cluster started", "dir", c.dir, "server", c.server, "nodes", len(c.nodes), "duration", time.Since(start).Round(time.Millisecond))
	return c, nil
}

// starting lets one cluster of this process start at a time. A start is
// mostly CPU (the API server's bootstrap, each kubelet's first second), and
// tests that run side by side would otherwise start theirs together: on a
// two-core machine the API servers then miss their readiness timeouts. A
// running cluster mostly waits, so clusters still run side by side.
var starting sync.Mutex

func validate(opts *Options) error {
	if opts.Dir == "" {
		return errors.New("cluster.Options.Dir is required")
	}
	dir, err := filepath.Abs(opts.Dir)
	if err != nil {
		return fmt.Errorf("resolve cluster dir %s: %w", opts.Dir, err)
	}
	opts.Dir = dir
	for _, hidden := range []string{"/var/lib", "/var/log", "/run", "/var/run"} {
		if dir == hidden || strings.HasPrefix(dir, hidden+"/") {
			return fmt.Errorf("cluster dir %s is under %s, which each kubelet's mount namespace replaces; use another dir", dir, hidden)
		}
	}
	real := 0
	for _, n := range opts.Nodes {
		if n.Runtime == RealContainerd {
			real++
		}
	}
	if real > maxRealNodes {
		return fmt.Errorf("%d real-runtime nodes: a cluster has at most %d (their pods share one /24)", real, maxRealNodes)
	}
	seen := map[string]bool{}
	for _, n := range opts.Nodes {
		if n.Name == "" || seen[n.Name] {
			return fmt.Errorf("node names must be unique and non-empty, got %q", n.Name)
		}
		seen[n.Name] = true
		// The longest socket a DRA plugin creates below the kubelet root.
		sock := filepath.Join(nodeDir(dir, n.Name), "kubelet", "plugins_registry", "gpu.tessera.dev-reg.sock")
		if len(sock) >= 108 {
			return fmt.Errorf("cluster dir %s is too long: socket path %s exceeds the 107-byte unix socket limit; use a shorter dir", dir, sock)
		}
	}
	return nil
}

func (c *Cluster) start(ctx context.Context, opts Options) error {
	for _, d := range []string{c.pkiDir(), c.logDir(), filepath.Join(c.dir, "kubeconfigs")} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return fmt.Errorf("create %s: %w", d, err)
		}
	}
	if c.runtimeBins != (RuntimeBinaries{}) {
		var err error
		if c.pods, err = newPodNetwork(c.dir); err != nil {
			return err
		}
	}
	if err := c.startControlPlane(ctx, opts); err != nil {
		return err
	}
	for _, spec := range opts.Nodes {
		n, err := c.newNode(ctx, spec)
		if err != nil {
			return err
		}
		c.nodes = append(c.nodes, n)
	}
	// Kubelets start in parallel: each spends its first second on CPU.
	errs := make([]error, len(c.nodes))
	var wg sync.WaitGroup
	for i, n := range c.nodes {
		wg.Go(func() { errs[i] = n.start(ctx, true) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return err
	}
	return c.waitForServiceAccount(ctx, metav1.NamespaceDefault)
}

// Stop stops every node and component (by process group) and unmounts
// anything left mounted below Dir. It is safe to call more than once. Dir
// itself is left for the caller to remove.
func (c *Cluster) Stop() {
	c.stopOnce.Do(func() {
		ctx := klog.NewContext(context.Background(), c.logger)
		for _, n := range c.nodes {
			n.stop(ctx)
		}
		for i := len(c.components) - 1; i >= 0; i-- {
			c.components[i].stop(5 * time.Second)
		}
		if c.pods != nil {
			c.pods.stop(ctx)
		}
		if err := unmountBelow(c.dir); err != nil {
			c.logger.Error(err, "Unmount below cluster dir failed", "dir", c.dir)
		}
		unregister(c)
		c.logger.V(2).Info("Cluster stopped", "dir", c.dir)
	})
}

// AdminKubeconfig is the path of a kubeconfig with cluster-admin rights.
func (c *Cluster) AdminKubeconfig() string { return c.adminKubeconfig }

// RESTConfig returns a copy of the admin client configuration.
func (c *Cluster) RESTConfig() *rest.Config { return rest.CopyConfig(c.restConfig) }

// Client is an admin client.
func (c *Cluster) Client() kubernetes.Interface { return c.client }

// Dir is the directory the cluster lives in.
func (c *Cluster) Dir() string { return c.dir }

// Nodes returns the cluster's nodes in the order of Options.Nodes.
func (c *Cluster) Nodes() []*Node { return append([]*Node(nil), c.nodes...) }

// Node returns the node with that name, or nil.
func (c *Cluster) Node(name string) *Node {
	for _, n := range c.nodes {
		if n.name == name {
			return n
		}
	}
	return nil
}

// CreateNamespace creates a namespace and waits until its default service
// account exists, so that pods can be created in it at once.
func (c *Cluster) CreateNamespace(ctx context.Context, name string) error {
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}
	if _, err := c.client.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create namespace %s: %w", name, err)
	}
	return c.waitForServiceAccount(ctx, name)
}

func (c *Cluster) waitForServiceAccount(ctx context.Context, namespace string) error {
	err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		_, err := c.client.CoreV1().ServiceAccounts(namespace).Get(ctx, "default", metav1.GetOptions{})
		return err == nil, nil
	})
	if err != nil {
		return fmt.Errorf("service account %s/default was not created (is the serviceaccount controller running? see %s): %w",
			namespace, c.logPath("kube-controller-manager"), err)
	}
	return nil
}

// nodeImages builds the archive of the images real-runtime nodes import
// (test/ociimage: pause and busybox) into Dir/images, once.
func (c *Cluster) nodeImages(ctx context.Context) (string, error) {
	c.nodeImagesOnce.Do(func() {
		start := time.Now()
		dir := filepath.Join(c.dir, "images")
		images, err := ociimage.NodeImages(ctx, ".", dir, ociimage.DebDir())
		if err != nil {
			c.nodeImagesError = fmt.Errorf("build the node images: %w", err)
			return
		}
		c.nodeImagesPath = filepath.Join(dir, "node-images.oci.tar")
		if err := ociimage.WriteArchive(c.nodeImagesPath, images); err != nil {
			c.nodeImagesError = fmt.Errorf("write the node images: %w", err)
			return
		}
		c.logger.V(2).Info("Built node images", "archive", c.nodeImagesPath, "duration", time.Since(start).Round(time.Millisecond))
	})
	return c.nodeImagesPath, c.nodeImagesError
}

// LogTails returns the last lines of every component's log, for printing
// when a test fails.
func (c *Cluster) LogTails(lines int) string {
	paths, _ := filepath.Glob(filepath.Join(c.logDir(), "*.log"))
	sort.Strings(paths)
	var b strings.Builder
	for _, p := range paths {
		fmt.Fprintf(&b, "==== last %d lines of %s\n%s\n", lines, p, tail(p, lines))
	}
	return b.String()
}

func (c *Cluster) pkiDir() string             { return filepath.Join(c.dir, "pki") }
func (c *Cluster) logDir() string             { return filepath.Join(c.dir, "logs") }
func (c *Cluster) logPath(name string) string { return filepath.Join(c.logDir(), name+".log") }
func nodeDir(clusterDir, name string) string  { return filepath.Join(clusterDir, "nodes", name) }
func (c *Cluster) kubeconfigPath(name string) string {
	return filepath.Join(c.dir, "kubeconfigs", name+".kubeconfig")
}

// loadClient builds the admin client from the admin kubeconfig.
func (c *Cluster) loadClient() error {
	cfg, err := clientcmd.BuildConfigFromFlags("", c.adminKubeconfig)
	if err != nil {
		return fmt.Errorf("load admin kubeconfig %s: %w", c.adminKubeconfig, err)
	}
	// Tests create objects in bursts; the default limits (5 qps, burst 10)
	// would make them wait.
	cfg.QPS, cfg.Burst = 100, 200
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return fmt.Errorf("create admin client: %w", err)
	}
	c.restConfig, c.client = cfg, client
	return nil
}
