package bench

import (
	"context"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"
	"k8s.io/klog/v2/ktesting"

	"github.com/tessera-dev/tessera/test/cluster"
	"github.com/tessera-dev/tessera/test/gpunode"
)

// shared is the control plane every benchmark of the package uses: started by
// the first benchmark that needs it (so that `go test` without -bench starts
// nothing) and stopped in TestMain.
var shared struct {
	once sync.Once
	c    *cluster.Cluster
	dir  string
	err  error
}

func TestMain(m *testing.M) {
	cluster.StopOnInterrupt()
	code := m.Run()
	if shared.c != nil {
		shared.c.Stop()
		if code == 0 && os.Getenv("TESSERA_KEEP_CLUSTER_DIR") == "" {
			_ = os.RemoveAll(shared.dir)
		}
	}
	os.Exit(code)
}

// controlPlane returns the package's control plane (etcd, apiserver,
// scheduler, controller manager; no nodes) with Tessera's RBAC and
// DeviceClasses installed.
func controlPlane(b *testing.B) *cluster.Cluster {
	b.Helper()
	shared.once.Do(func() {
		// Not the benchmark's logger: the control plane outlives it. Its
		// components log to files in its dir; start-up errors are returned.
		ctx := klog.NewContext(context.Background(), logr.Discard())
		if shared.dir, shared.err = os.MkdirTemp("", "tb-"); shared.err != nil {
			return
		}
		if shared.c, shared.err = cluster.Start(ctx, cluster.Options{Dir: shared.dir}); shared.err != nil {
			return
		}
		shared.err = gpunode.Install(ctx, shared.c)
	})
	if shared.err != nil {
		b.Fatalf("start control plane in %s: %v", shared.dir, shared.err)
	}
	return shared.c
}

// createNode creates a Node object without a kubelet: the plugin publishes
// its slices with the Node as owner.
func createNode(ctx context.Context, c *cluster.Cluster, name string) error {
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"kubernetes.io/hostname": name}}}
	if _, err := c.Client().CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create node %s: %w", name, err)
	}
	return nil
}

var seq atomic.Int64

// unique returns prefix-<n>, a fresh name per call: the testing package
// calls a benchmark function more than once (b.N = 1 first), and each call
// gets its own node, namespace and claims.
func unique(prefix string) string {
	return fmt.Sprintf("%s-%d", prefix, seq.Add(1))
}

// benchContext is the benchmark's context with a logger writing to its log
// at verbosity 0: benchmark logs are printed after the result line, so the
// plugin's messages never split it.
func benchContext(b *testing.B) context.Context {
	return klog.NewContext(b.Context(), ktesting.NewLogger(b, ktesting.NewConfig(ktesting.Verbosity(0))))
}
