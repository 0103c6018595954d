package e2e

import (
	"context"
	"fmt"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/driver/inventory"
	"github.com/tessera-dev/tessera/test/cluster"
	"github.com/tessera-dev/tessera/test/fixtures"
	"github.com/tessera-dev/tessera/test/gpunode"
)

// BenchmarkGangPlacement measures, on the real apiserver, scheduler and
// controller manager, the time from a gang's creation (with its pods, their
// claims from a template and a shared domain claim) to every member bound by
// the scheduler (spec.nodeName set), for gangs of 64, 128, 256 and 512 one-GPU
// members on simulated 8-GPU nodes (DGX B200 slices, one NVLink clique,
// published through the API; Node objects kept Ready by renewing their
// Leases; no kubelets). Each size runs on a fresh cluster with size/8 nodes.
// A gang of 512 cannot share a domain claim (a claim serves at most 256
// pods), so it runs without one, still confined to the clique. Reported as
// gang_<N>_s.
func BenchmarkGangPlacement(b *testing.B) {
	for _, size := range []int{64, 128, 256, 512} {
		b.Run(fmt.Sprintf("pods=%d", size), func(b *testing.B) {
			var total time.Duration
			for range b.N {
				total += placeGangOnce(b, size)
			}
			b.ReportMetric(total.Seconds()/float64(b.N), fmt.Sprintf("gang_%d_s", size))
		})
	}
}

func placeGangOnce(b *testing.B, size int) time.Duration {
	b.StopTimer()
	c, ctx, kubeconfig := startBenchCluster(b, 10*time.Minute)
	client := c.Client()
	nodes := size / 8
	// A DGX B200 (8 GPUs) placed in the GB200 trays' clique.
	p := fixtures.Profile(b, "dgx-b200")
	p.Fabric = fixtures.Profile(b, "gb200-nvl72-tray").Fabric
	published := make([][]*resourceapi.ResourceSlice, nodes)
	for i := range published {
		published[i] = fixtures.Slices(b, p, simNodeName(i), inventory.Options{})
	}
	stopLeases := simulateNodes(ctx, b, client, published)
	defer stopLeases()
	ctl := startController(b, kubeconfig, "", nil)
	defer ctl.stop()
	waitDomainNodes(ctx, b, c, nodes)

	const ns = "bench"
	if err := c.CreateNamespace(ctx, ns); err != nil {
		b.Fatal(err)
	}
	noErr(b, ok(client.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, gpuTemplate(ns, "one-gpu", 1), metav1.CreateOptions{})))
	domainName := ""
	if size <= gangv1.MaxSizeWithDomainClaim {
		domainName = "bench-domain"
		noErr(b, ok(client.ResourceV1().ResourceClaims(ns).Create(ctx, domainClaim(ns, domainName), metav1.CreateOptions{})))
	}
	gs := newGangs(b, c)
	b.StartTimer()
	began := time.Now()
	gs.create(ctx, b, labelGang(ns, "bench", int32(size), domainName))
	tc := &tesseraCluster{Cluster: c}
	tc.createMembers(ctx, b, ns, "bench", "one-gpu", domainName, size)
	created := time.Since(began)
	bound := 0
	err := wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, 5*time.Minute, true, func(ctx context.Context) (bool, error) {
		list, err := client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		bound = 0
		for _, p := range list.Items {
			if p.Spec.NodeName != "" {
				bound++
			}
		}
		return bound == size, nil
	})
	elapsed := time.Since(began)
	b.StopTimer()
	if err != nil {
		g := gs.get(ctx, b, ns, "bench")
		b.Fatalf("%d of %d pods bound after %v:\n%s", bound, size, elapsed, describeConditions(g))
	}
	b.Logf("gang of %d on %d nodes: pods created in %v, all bound in %v", size, nodes, created.Round(time.Millisecond), elapsed.Round(time.Millisecond))
	return elapsed
}

// startBenchCluster starts a local cluster with Tessera's classes and the
// controller's account and policies installed (not the controller), and a
// context that ends after timeout or with b; it returns the controller's
// kubeconfig too.
func startBenchCluster(b *testing.B, timeout time.Duration) (*cluster.Cluster, context.Context, string) {
	b.Helper()
	c := cluster.StartT(b, cluster.Options{})
	ctx, cancel := context.WithTimeout(b.Context(), timeout)
	b.Cleanup(cancel)
	if err := gpunode.Install(ctx, c); err != nil {
		b.Fatal(err)
	}
	kubeconfig, err := installController(ctx, c)
	if err != nil {
		b.Fatal(err)
	}
	return c, ctx, kubeconfig
}

// waitDomainNodes waits until one domain pool covers n nodes.
func waitDomainNodes(ctx context.Context, b *testing.B, c *cluster.Cluster, n int) {
	b.Helper()
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		list, err := c.Client().ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		for _, s := range list.Items {
			if s.Spec.NodeName == nil && s.Spec.NodeSelector != nil && len(s.Spec.NodeSelector.NodeSelectorTerms[0].MatchExpressions) == 1 &&
				len(s.Spec.NodeSelector.NodeSelectorTerms[0].MatchExpressions[0].Values) == n {
				return true, nil
			}
		}
		return false, nil
	})
	if err != nil {
		b.Fatalf("no domain pool of %d nodes published: %v", n, err)
	}
}
