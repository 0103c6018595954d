package bench

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/tessera-dev/tessera/deployments/rbac"
	"github.com/tessera-dev/tessera/driver/nodeopen"
	"github.com/tessera-dev/tessera/driver/plugin"
	"github.com/tessera-dev/tessera/test/cluster"
	"github.com/tessera-dev/tessera/test/gpunode"
	"github.com/tessera-dev/tessera/test/kubeletsim"
)

// benchNode is Tessera's real kubelet plugin running in this process on a
// simulated node, against the shared control plane as its own service
// account, with a simulated kubelet on its real unix sockets.
type benchNode struct {
	name    string
	dir     string
	opts    plugin.Options
	client  kubernetes.Interface // the plugin's own client
	plugin  *plugin.Plugin
	kubelet *kubeletsim.Kubelet
}

// startNode starts the plugin for a fake node of the given profile, with the
// client rate limits given (the plugin's flags --kube-api-qps and
// --kube-api-burst), and registers it with the simulated kubelet. rolling
// starts it as the chart does, with its pod's UID (--pod-uid), which turns
// on the rolling-update mode: the state shared through the checkpoint on
// disk and the node's file locks. It is stopped when the benchmark ends.
// adjust, if given, changes further options (feature gates).
func startNode(b *testing.B, c *cluster.Cluster, name, profile string, qps float32, burst int, rolling bool, adjust ...func(*plugin.Options)) *benchNode {
	b.Helper()
	ctx := benchContext(b)
	if err := createNode(ctx, c, name); err != nil {
		b.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "tb-node-") // short: unix socket paths
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = os.RemoveAll(dir) })
	bootID := filepath.Join(dir, "boot_id")
	if err := os.WriteFile(bootID, []byte("5b0c2a4e-bench\n"), 0o644); err != nil {
		b.Fatal(err)
	}
	n := &benchNode{name: name, dir: dir, opts: plugin.Options{
		Node:          nodeopen.Options{NodeName: name, FakeNode: profile, FakeRoot: filepath.Join(dir, "host")},
		CDIRoot:       cdiRoot(b, dir),
		PluginDataDir: filepath.Join(dir, "plugin"),
		RegistrarDir:  filepath.Join(dir, "reg"),
		BootIDFile:    bootID,
		KubeAPIQPS:    qps,
		KubeAPIBurst:  burst,
	}}
	if rolling {
		n.opts.PodUID = "bench-pod-" + name
	}
	for _, f := range adjust {
		f(&n.opts)
	}
	if err := n.opts.Validate(); err != nil {
		b.Fatal(err)
	}
	// The kubelet owns and creates its registration directory.
	if err := os.MkdirAll(n.opts.RegistrarDir, 0o750); err != nil {
		b.Fatal(err)
	}
	if n.opts.Kubeconfig, err = c.ServiceAccountKubeconfig(ctx, rbac.Namespace, rbac.KubeletPluginAccount); err != nil {
		b.Fatal(err)
	}
	if n.client, err = plugin.NewClient(n.opts); err != nil {
		b.Fatal(err)
	}
	if n.plugin, err = plugin.Start(ctx, n.opts, n.client); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(n.plugin.Stop)
	regCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if n.kubelet, err = kubeletsim.Register(regCtx, n.opts.RegistrarDir); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = n.kubelet.Close() })
	return n
}

// claim creates a claim for one device of the node in the API server and
// writes its allocation as the scheduler would (UpdateStatus, as admin), so
// that the plugin fetches a real, allocated claim.
func (n *benchNode) claim(ctx context.Context, c *cluster.Cluster, namespace, name, device string) (kubeletsim.Claim, error) {
	class := gpunode.DriverName
	if strings.Contains(device, "-mig-") {
		class = "mig." + gpunode.DriverName
	}
	rc := &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
			Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: class},
		}}}},
	}
	claims := c.Client().ResourceV1().ResourceClaims(namespace)
	created, err := claims.Create(ctx, rc, metav1.CreateOptions{})
	if err != nil {
		return kubeletsim.Claim{}, fmt.Errorf("create claim %s/%s: %w", namespace, name, err)
	}
	now := metav1.Now()
	created.Status.Allocation = &resourceapi.AllocationResult{
		Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{{
			Request: "gpu", Driver: gpunode.DriverName, Pool: n.name, Device: device,
		}}},
		NodeSelector: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{
			MatchFields: []corev1.NodeSelectorRequirement{{Key: "metadata.name", Operator: corev1.NodeSelectorOpIn, Values: []string{n.name}}},
		}}},
		AllocationTimestamp: &now,
	}
	if _, err := claims.UpdateStatus(ctx, created, metav1.UpdateOptions{}); err != nil {
		return kubeletsim.Claim{}, fmt.Errorf("allocate claim %s/%s to %s: %w", namespace, name, device, err)
	}
	return kubeletsim.Claim{Namespace: namespace, Name: name, UID: created.UID}, nil
}

// cycle prepares and then unprepares one claim over the plugin's socket, as
// the kubelet does for a pod that starts and ends.
func (n *benchNode) cycle(ctx context.Context, c kubeletsim.Claim) error {
	resp, err := n.kubelet.Prepare(ctx, c)
	if err != nil {
		return fmt.Errorf("prepare %s: %w", c.Name, err)
	}
	if r := resp.Claims[string(c.UID)]; r == nil || r.Error != "" || len(r.Devices) == 0 {
		return fmt.Errorf("prepare %s: %v", c.Name, resp.Claims[string(c.UID)])
	}
	uresp, err := n.kubelet.Unprepare(ctx, c)
	if err != nil {
		return fmt.Errorf("unprepare %s: %w", c.Name, err)
	}
	if r := uresp.Claims[string(c.UID)]; r == nil || r.Error != "" {
		return fmt.Errorf("unprepare %s: %v", c.Name, uresp.Claims[string(c.UID)])
	}
	return nil
}

// cdiRoot is a directory for the node's CDI specs on tmpfs, as a node's
// /var/run/cdi is, when /dev/shm is tmpfs; otherwise (logged) one in dir.
// Spec writes on a disk file system cost the plugin several times the CPU
// they do on tmpfs, most of it in the directory's lock under concurrency.
func cdiRoot(b *testing.B, dir string) string {
	b.Helper()
	var st syscall.Statfs_t
	if err := syscall.Statfs("/dev/shm", &st); err != nil || st.Type != tmpfsMagic {
		b.Logf("CDI specs on %s's file system, not tmpfs: /dev/shm is not tmpfs here (%v)", dir, err)
		return filepath.Join(dir, "cdi")
	}
	root, err := os.MkdirTemp("/dev/shm", "tb-cdi-")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = os.RemoveAll(root) })
	return root
}

// tmpfsMagic is TMPFS_MAGIC from linux/magic.h.
const tmpfsMagic = 0x01021994

// checkpointWrites is how many times the plugin has written its checkpoint
// (the count of tessera_checkpoint_write_duration_seconds).
func (n *benchNode) checkpointWrites(b *testing.B) writeStats {
	b.Helper()
	families, err := n.plugin.Metrics().Gather()
	if err != nil {
		b.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() == "tessera_checkpoint_write_duration_seconds" && len(f.GetMetric()) == 1 {
			h := f.GetMetric()[0].GetHistogram()
			return writeStats{n: float64(h.GetSampleCount()), seconds: h.GetSampleSum()}
		}
	}
	b.Fatal("the plugin's metrics lack tessera_checkpoint_write_duration_seconds")
	return writeStats{}
}

// writeStats are the plugin's checkpoint writes so far: how many, and the
// seconds spent writing them (each with its fsync).
type writeStats struct{ n, seconds float64 }
