package cluster

import (
	"context"
	"crypto/tls"
	"fmt"
	"maps"
	"net"
	"net/http"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

// controllers are the kube-controller-manager controllers a cluster runs:
// what DRA, pods and service accounts need, and node lifecycle so that a node
// loses its not-ready taint.
var controllers = []string{
	"serviceaccount-token-controller",
	"serviceaccount-controller",
	"root-ca-certificate-publisher-controller",
	"namespace-controller",
	"garbage-collector-controller",
	"node-lifecycle-controller",
	"taint-eviction-controller",
	"pod-garbage-collector-controller",
	"resourceclaim-controller",
	"device-taint-eviction-controller",
	"replicaset-controller",
	"deployment-controller",
	// Services' endpoints, where the API server calls webhooks.
	"endpointslice-controller",
	"daemonset-controller",
	"job-controller",
	"statefulset-controller",
	"clusterrole-aggregation-controller",
	// Removes the finalizer the PodGroupProtection admission plugin puts on
	// every PodGroup once its pods are gone.
	"podgroup-protection-controller",
}

// featureGates are the gates every component runs with: the PodGroup API,
// pods joining a group (spec.schedulingGroup), the scheduler's gang plugin
// and claims shared by a PodGroup (beta in 1.37, off by default); with
// opts.CompositePodGroups, CompositePodGroups and what they need (alpha).
func featureGates(opts Options) map[string]bool {
	gates := map[string]bool{"GenericWorkload": true, "DRAWorkloadResourceClaims": true}
	if opts.CompositePodGroups {
		gates["CompositePodGroup"], gates["TopologyAwareWorkloadScheduling"] = true, true
	}
	return gates
}

// featureGatesFlag is c.gates as a component's flag.
func (c *Cluster) featureGatesFlag() string {
	var on []string
	for _, g := range slices.Sorted(maps.Keys(c.gates)) {
		on = append(on, fmt.Sprintf("%s=%t", g, c.gates[g]))
	}
	return "--feature-gates=" + strings.Join(on, ",")
}

// runtimeConfig is the API server's --runtime-config: PodGroups are read in
// v1beta1 by the scheduler and the resourceclaim controller, and
// CompositePodGroups are served in v1alpha3 only.
func (c *Cluster) runtimeConfig() string {
	apis := "resource.k8s.io/v1=true,scheduling.k8s.io/v1beta1=true"
	if c.gates["CompositePodGroup"] {
		apis += ",scheduling.k8s.io/v1alpha3=true"
	}
	return "--runtime-config=" + apis
}

func (c *Cluster) startControlPlane(ctx context.Context, opts Options) error {
	ca, err := newCertAuthority(c.pkiDir())
	if err != nil {
		return err
	}
	c.ca = ca
	saKey, saPub, err := writeServiceAccountKeys(c.pkiDir())
	if err != nil {
		return err
	}
	ports, err := FreePorts(5)
	if err != nil {
		return err
	}
	etcdClient, etcdPeer, apiPort, schedPort, cmPort := ports[0], ports[1], ports[2], ports[3], ports[4]

	etcdURL := fmt.Sprintf("http://127.0.0.1:%d", etcdClient)
	peerURL := fmt.Sprintf("http://127.0.0.1:%d", etcdPeer)
	etcd, err := c.startComponent(ctx, "etcd", []string{c.bins.Etcd,
		"--name=default",
		"--data-dir=" + filepath.Join(c.dir, "etcd"),
		"--listen-client-urls=" + etcdURL, "--advertise-client-urls=" + etcdURL,
		"--listen-peer-urls=" + peerURL, "--initial-advertise-peer-urls=" + peerURL,
		"--initial-cluster=default=" + peerURL,
		"--unsafe-no-fsync", "--log-level=warn",
	})
	if err != nil {
		return err
	}
	if err := etcd.waitFor(ctx, "health", 30*time.Second, httpCheck(etcdURL+"/health")); err != nil {
		return err
	}

	// Certificates and kubeconfigs for the apiserver and its clients.
	hosts := []string{"127.0.0.1", "localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "10.0.0.1"}
	if c.pods != nil {
		hosts = append(hosts, c.pods.gateway.String()) // PodAPIServer
	}
	serving, err := ca.issue(c.pkiDir(), "apiserver", "kube-apiserver", nil, hosts)
	if err != nil {
		return err
	}
	c.server = fmt.Sprintf("https://127.0.0.1:%d", apiPort)
	clients := []struct{ name, user, group string }{
		{"admin", "tessera-admin", "system:masters"},
		{"kube-scheduler", "system:kube-scheduler", ""},
		{"kube-controller-manager", "system:kube-controller-manager", ""},
	}
	for _, cl := range clients {
		var groups []string
		if cl.group != "" {
			groups = []string{cl.group}
		}
		kp, err := ca.issue(c.pkiDir(), cl.name+"-client", cl.user, groups, nil)
		if err != nil {
			return err
		}
		if err := writeKubeconfig(c.kubeconfigPath(cl.name), c.server, ca.certPEM, cl.user,
			credentials{certPEM: kp.CertPEM, keyPEM: kp.KeyPEM}); err != nil {
			return err
		}
	}
	c.adminKubeconfig = c.kubeconfigPath("admin")
	// The API server calls a kubelet (a pod's log, exec) at its Node's
	// InternalIP, which only real-runtime nodes have (Node.IP), with a
	// client certificate of the cluster's CA, and checks the kubelet's
	// serving certificate against the CA and that address.
	kubeletClient, err := ca.issue(c.pkiDir(), "apiserver-kubelet-client", "kube-apiserver-kubelet-client", nil, nil)
	if err != nil {
		return err
	}
	if err := c.loadClient(); err != nil {
		return err
	}

	audit, err := c.auditFlags()
	if err != nil {
		return err
	}
	apiserver, err := c.startComponent(ctx, "kube-apiserver", append([]string{c.bins.APIServer,
		"--etcd-servers=" + etcdURL,
		"--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", fmt.Sprintf("--secure-port=%d", apiPort),
		"--tls-cert-file=" + serving.CertFile, "--tls-private-key-file=" + serving.KeyFile,
		"--client-ca-file=" + caFile(c.pkiDir()),
		"--kubelet-preferred-address-types=InternalIP",
		"--kubelet-client-certificate=" + kubeletClient.CertFile, "--kubelet-client-key=" + kubeletClient.KeyFile,
		"--kubelet-certificate-authority=" + caFile(c.pkiDir()),
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file=" + saPub, "--service-account-signing-key-file=" + saKey,
		"--authorization-mode=Node,RBAC",
		"--enable-admission-plugins=NodeRestriction",
		c.runtimeConfig(),
		c.featureGatesFlag(),
		"--endpoint-reconciler-type=none",
		"--service-cluster-ip-range=10.0.0.0/24",
		// No Service proxy runs: the API server calls webhooks at their
		// Services' endpoints (the pods' addresses) rather than at the
		// Services' cluster IPs.
		"--enable-aggregator-routing=true",
		"--allow-privileged=true",
		"--profiling=false",
		"--v=1",
	}, audit...))
	if err != nil {
		return err
	}
	if err := apiserver.waitFor(ctx, "readyz", 60*time.Second, func(ctx context.Context) error {
		_, err := c.client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
		return err
	}); err != nil {
		return err
	}
	if c.pods != nil {
		if err := c.pods.startRelay(ctx, apiPort); err != nil {
			return err
		}
	}

	// As for the controller manager below: at the default 50 qps the
	// scheduler's binds and events alone take ~10 s for a 256-pod gang.
	qps, burst := 200, 400
	if opts.SchedulerAPIQPS > 0 {
		qps = opts.SchedulerAPIQPS
	}
	if opts.SchedulerAPIBurst > 0 {
		burst = opts.SchedulerAPIBurst
	}
	scheduler, err := c.startComponent(ctx, "kube-scheduler", []string{c.bins.Scheduler,
		"--kubeconfig=" + c.kubeconfigPath("kube-scheduler"),
		"--leader-elect=false",
		"--bind-address=127.0.0.1", fmt.Sprintf("--secure-port=%d", schedPort),
		"--cert-dir=" + filepath.Join(c.dir, "kube-scheduler"),
		fmt.Sprintf("--kube-api-qps=%d", qps), fmt.Sprintf("--kube-api-burst=%d", burst),
		// Client certificates of the cluster's CA authenticate, and the
		// apiserver authorizes, requests to /metrics and /debug/pprof
		// (SchedulerGet); without these only the health paths answer.
		"--client-ca-file=" + caFile(c.pkiDir()),
		"--authorization-kubeconfig=" + c.kubeconfigPath("kube-scheduler"),
		c.featureGatesFlag(),
		"--v=2",
	})
	if err != nil {
		return err
	}
	c.scheduler, c.schedPort = scheduler, schedPort
	cm, err := c.startComponent(ctx, "kube-controller-manager", []string{c.bins.ControllerManager,
		"--kubeconfig=" + c.kubeconfigPath("kube-controller-manager"),
		"--leader-elect=false",
		"--bind-address=127.0.0.1", fmt.Sprintf("--secure-port=%d", cmPort),
		"--cert-dir=" + filepath.Join(c.dir, "kube-controller-manager"),
		"--use-service-account-credentials=true",
		"--service-account-private-key-file=" + saKey,
		"--root-ca-file=" + caFile(c.pkiDir()),
		"--controllers=" + strings.Join(controllers, ","),
		// Large clusters raise client-go's 20 qps: at the default the
		// resourceclaim controller (two writes per pod) alone takes ~30 s
		// to give a 256-pod gang its claims.
		"--kube-api-qps=200", "--kube-api-burst=400",
		c.featureGatesFlag(),
		"--v=2",
	})
	if err != nil {
		return err
	}
	if err := scheduler.waitFor(ctx, "healthz", 60*time.Second, httpCheck(fmt.Sprintf("https://127.0.0.1:%d/healthz", schedPort))); err != nil {
		return err
	}
	return cm.waitFor(ctx, "healthz", 60*time.Second, httpCheck(fmt.Sprintf("https://127.0.0.1:%d/healthz", cmPort)))
}

func (c *Cluster) startComponent(ctx context.Context, name string, argv []string) (*process, error) {
	p, err := startProcess(ctx, name, filepath.Join(c.dir, "run", name), c.logPath(name), argv)
	if err != nil {
		return nil, err
	}
	c.components = append(c.components, p)
	return p, nil
}

// httpCheck succeeds when url answers 200. The components' serving
// certificates are self-signed, and only loopback is dialled.
func httpCheck(url string) func(context.Context) error {
	client := &http.Client{
		Timeout:   2 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}, //nolint:gosec // loopback health check
	}
	return func(ctx context.Context) error {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return err
		}
		resp, err := client.Do(req)
		if err != nil {
			return err
		}
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("GET %s: %s", url, resp.Status)
		}
		return nil
	}
}

// FreePorts returns n distinct free TCP ports on 127.0.0.1, e.g. for
// hostNetwork pods of a real-runtime node.
func FreePorts(n int) ([]int, error) {
	var ports []int
	var listeners []net.Listener
	defer func() {
		for _, l := range listeners {
			_ = l.Close()
		}
	}()
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("find a free port on 127.0.0.1: %w", err)
		}
		listeners = append(listeners, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}
