package e2e

import (
	"context"
	"errors"
	"fmt"
	"sync"
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
// Leases; no kubelets). Each size runs on a fresh cluster with size/8 nodes,
// each of -benchtime's iterations on a fresh one. A gang of 512 cannot share
// a domain claim (a claim serves at most 256 pods), so it runs without one,
// still confined to the clique. Before the gang, on the same cluster, it
// measures the gang's floor: as many one-GPU pods of the same template
// without a gang, from creation to every pod bound (then deleted, their
// claims gone). Reported, each the median over the iterations with how many
// (-n) and the lowest and highest (-lo, -hi): gang_<N>_s, plain_<N>_s and
// gang_<N>_vs_plain (each iteration's gang over its floor: on a busy
// machine both slow down).
func BenchmarkGangPlacement(b *testing.B) {
	for _, size := range []int{64, 128, 256, 512} {
		b.Run(fmt.Sprintf("pods=%d", size), func(b *testing.B) {
			var gang, plain, ratio []float64
			// b.Loop, not b.N: exactly -benchtime's iterations, where
			// b.N would run one more first.
			for b.Loop() {
				g, p := placeGangOnce(b, size)
				gang, plain, ratio = append(gang, g.Seconds()), append(plain, p.Seconds()), append(ratio, g.Seconds()/p.Seconds())
				b.StartTimer() // placeGangOnce stops it; b.Loop needs it running
			}
			reportRuns(b, gang, fmt.Sprintf("gang_%d_s", size))
			reportRuns(b, plain, fmt.Sprintf("plain_%d_s", size))
			reportRuns(b, ratio, fmt.Sprintf("gang_%d_vs_plain", size))
		})
	}
}

// placeGangOnce places one gang of size on a fresh cluster and returns how
// long it took and how long its floor took on the same cluster just before.
func placeGangOnce(b *testing.B, size int) (time.Duration, time.Duration) {
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
	// The floor before the controller starts: it finds the GPUs free.
	plain := placePlainOnce(ctx, b, c, size)
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
	bound, err := waitBound(ctx, c, ns, size)
	elapsed := time.Since(began)
	b.StopTimer()
	if err != nil {
		g := gs.get(ctx, b, ns, "bench")
		b.Fatalf("%d of %d pods bound after %v:\n%s", bound, size, elapsed, describeConditions(g))
	}
	b.Logf("gang of %d on %d nodes: pods created in %v, all bound in %v (%d plain pods: %v)", size, nodes, created.Round(time.Millisecond), elapsed.Round(time.Millisecond), size, plain.Round(time.Millisecond))
	return elapsed, plain
}

// placePlainOnce is a gang's floor: size one-GPU pods of the same template
// (in a namespace of their own) without a gang, created all at once as the
// members are, from creation to every pod bound. Then, untimed, it deletes
// them and waits until their claims are gone, so that the gang finds every
// GPU free.
func placePlainOnce(ctx context.Context, b *testing.B, c *cluster.Cluster, size int) time.Duration {
	b.Helper()
	const ns = "bench-floor"
	client := c.Client()
	if err := c.CreateNamespace(ctx, ns); err != nil {
		b.Fatal(err)
	}
	noErr(b, ok(client.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, gpuTemplate(ns, "one-gpu", 1), metav1.CreateOptions{})))
	began := time.Now()
	var wg sync.WaitGroup
	errs := make([]error, size)
	for i := range size {
		wg.Go(func() {
			_, errs[i] = client.CoreV1().Pods(ns).Create(ctx, newGPUPod(ns, fmt.Sprintf("plain-%d", i), gpuFrom("one-gpu")), metav1.CreateOptions{})
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		b.Fatal(err)
	}
	bound, err := waitBound(ctx, c, ns, size)
	elapsed := time.Since(began)
	if err != nil {
		b.Fatalf("floor: %d of %d plain pods bound after %v: %v", bound, size, elapsed, err)
	}
	if err := client.CoreV1().Pods(ns).DeleteCollection(ctx, metav1.DeleteOptions{GracePeriodSeconds: new(int64)}, metav1.ListOptions{}); err != nil {
		b.Fatal(err)
	}
	err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		claims, err := client.ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
		return err == nil && len(claims.Items) == 0, nil
	})
	if err != nil {
		b.Fatalf("floor: the plain pods' claims are not gone: %v", err)
	}
	return elapsed
}

// waitBound waits until size pods of ns are bound to a node and returns how
// many are.
func waitBound(ctx context.Context, c *cluster.Cluster, ns string, size int) (int, error) {
	bound := 0
	err := wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, 5*time.Minute, true, func(ctx context.Context) (bool, error) {
		list, err := c.Client().CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
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
	return bound, err
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
