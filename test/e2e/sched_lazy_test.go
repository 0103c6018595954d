package e2e

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"

	"github.com/tessera-dev/tessera/driver/discovery"
	"github.com/tessera-dev/tessera/driver/inventory"
	"github.com/tessera-dev/tessera/driver/lazymig"
	tslices "github.com/tessera-dev/tessera/driver/slices"
)

// lazyNodes plays, for the benchmark's lazy cases, what each simulated
// node's kubelet plugin does after a prepare: the benchmark has no kubelets,
// so a claim the scheduler allocates on a node counts as prepared at once,
// and the node's devices are republished with driver/lazymig's decision
// rendered by slices.Build, as the plugin renders it. A node whose spare
// was taken whole publishes the next GPU's partitions; one whose partitions
// filled a GPU opens the next. Nothing is released while the benchmark
// runs, so nothing is ever withdrawn after a grace.
type lazyNodes struct {
	client kubernetes.Interface
	gpus   map[string][]discovery.GPU // by node name
	layout inventory.Options
	queue  workqueue.TypedRateLimitingInterface[string]

	mu        sync.Mutex
	held      map[string]map[string]bool // node -> device names allocated
	published map[string]map[string]lazymig.State
	seen      map[string]bool // claim UIDs counted
	writes    int
}

// republishLazily starts lazyNodes for the nodes' claims in namespace ns;
// stop waits for it to end and returns how many slice writes it made.
func republishLazily(ctx context.Context, b testing.TB, client kubernetes.Interface, ns string, gpus [][]discovery.GPU, layout inventory.Options) (stop func() int) {
	l := &lazyNodes{client: client, gpus: map[string][]discovery.GPU{}, layout: layout,
		queue: workqueue.NewTypedRateLimitingQueue(workqueue.DefaultTypedControllerRateLimiter[string]()),
		held:  map[string]map[string]bool{}, published: map[string]map[string]lazymig.State{}, seen: map[string]bool{}}
	for i := range gpus {
		l.gpus[simNodeName(i)] = gpus[i]
	}
	ctx, cancel := context.WithCancel(ctx)
	factory := informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithNamespace(ns))
	inf := factory.Resource().V1().ResourceClaims().Informer()
	observe := func(obj any) {
		c, ok := obj.(*resourceapi.ResourceClaim)
		if !ok || c.Status.Allocation == nil {
			return
		}
		l.mu.Lock()
		defer l.mu.Unlock()
		if l.seen[string(c.UID)] {
			return
		}
		l.seen[string(c.UID)] = true
		for _, r := range c.Status.Allocation.Devices.Results {
			if l.held[r.Pool] == nil {
				l.held[r.Pool] = map[string]bool{}
			}
			l.held[r.Pool][r.Device] = true
			l.queue.Add(r.Pool)
		}
	}
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: observe, UpdateFunc: func(_, o any) { observe(o) }}); err != nil {
		b.Fatal(err)
	}
	factory.Start(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		b.Fatal("the claim informer did not sync")
	}
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for {
				node, quit := l.queue.Get()
				if quit {
					return
				}
				if err := l.republish(ctx, node); err != nil && ctx.Err() == nil {
					b.Logf("republishing %s: %v", node, err)
					l.queue.AddRateLimited(node)
				} else {
					l.queue.Forget(node)
				}
				l.queue.Done(node)
			}
		})
	}
	return func() int {
		cancel()
		l.queue.ShutDown()
		wg.Wait()
		factory.Shutdown()
		l.mu.Lock()
		defer l.mu.Unlock()
		return l.writes
	}
}

// republish decides for a node from what it holds and writes its device
// slice when the devices changed.
func (l *lazyNodes) republish(ctx context.Context, node string) error {
	inv := inventory.Build(l.gpus[node], l.layout)
	l.mu.Lock()
	partitioned, whole := map[string]bool{}, map[string]bool{}
	for name := range l.held[node] {
		d, ok := inv.Lookup(name)
		switch {
		case !ok:
		case d.Kind == inventory.Partition:
			partitioned[d.GPU.Name()] = true
		default:
			whole[d.GPU.Name()] = true
		}
	}
	var in []lazymig.GPU
	for _, g := range tslices.LazyGPUs(inv) {
		in = append(in, lazymig.GPU{Name: g, Partitioned: partitioned[g], WholeHeld: whole[g], Published: l.published[node][g]})
	}
	d := lazymig.Decide(in, lazymig.DefaultPolicy, time.Now())
	l.published[node] = d.States
	l.mu.Unlock()
	res, err := tslices.Build(node, inv, tslices.Options{Lazy: &d})
	if err != nil {
		return err
	}
	var devices [][]resourceapi.Device
	for _, s := range res.Pools[node].Slices {
		if len(s.Devices) > 0 {
			devices = append(devices, s.Devices)
		}
	}
	if len(devices) != 1 {
		return fmt.Errorf("the node's devices fill %d slices; the benchmark republishes one", len(devices))
	}
	list, err := l.client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + node})
	if err != nil {
		return err
	}
	for i := range list.Items {
		s := &list.Items[i]
		if !strings.HasPrefix(s.Name, "00000-") {
			continue
		}
		if devicesEqual(s.Spec.Devices, devices[0]) {
			return nil
		}
		s.Spec.Devices = devices[0]
		if _, err := l.client.ResourceV1().ResourceSlices().Update(ctx, s, metav1.UpdateOptions{}); err != nil {
			return err
		}
		l.mu.Lock()
		l.writes++
		l.mu.Unlock()
		return nil
	}
	return fmt.Errorf("no device slice of node %s", node)
}

// devicesEqual compares device lists by name and by whether each draws on
// counters: what a decision changes.
func devicesEqual(a, b []resourceapi.Device) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i].Name != b[i].Name || len(a[i].ConsumesCounters) != len(b[i].ConsumesCounters) {
			return false
		}
	}
	return true
}
