package plugin

import (
	"context"
	"fmt"
	"sync"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"

	"github.com/tessera-dev/tessera/driver/inventory"
	"github.com/tessera-dev/tessera/driver/lazymig"
	"github.com/tessera-dev/tessera/driver/prepare"
	"github.com/tessera-dev/tessera/driver/slices"
)

// lazyMIG feeds driver/lazymig for the publish loop: what the node holds
// (the checkpoint, read from disk in a rolling update, and the prepares in
// flight), what it published last, and when to decide again. Before it
// withdraws a free GPU's partitions it reads the node's slices and checks
// that the API has shown the withdrawal taint for the whole grace period;
// a countdown the scheduler has not seen starts again from what it saw.
type lazyMIG struct {
	policy lazymig.Policy
	clock  clock.WithTicker
	client kubernetes.Interface
	node   string
	claims *prepare.Manager
	// wake asks the publish loop to decide again (a prepare began or
	// ended); buffered, one pending wake is enough.
	wake chan struct{}

	mu sync.Mutex
	// pins counts the prepares in flight per device name: their devices
	// are held before the checkpoint says so.
	pins map[string]int
	// last is what the loop published last, by GPU name.
	last map[string]lazymig.State
	// started: last was read from the API (the loop's goroutine only).
	started bool
}

func newLazyMIG(policy lazymig.Policy, clk clock.WithTicker, client kubernetes.Interface, node string, claims *prepare.Manager) *lazyMIG {
	return &lazyMIG{policy: policy, clock: clk, client: client, node: node, claims: claims, wake: make(chan struct{}, 1), pins: map[string]int{}}
}

// poke asks for a new decision.
func (l *lazyMIG) poke() {
	select {
	case l.wake <- struct{}{}:
	default:
	}
}

// pin holds the node's devices a claim was allocated while it is prepared,
// so that no decision withdraws their GPU's partitions meanwhile; the
// returned func releases them. Both ask for a new decision.
func (l *lazyMIG) pin(c *resourceapi.ResourceClaim) func() {
	names := l.devices(c)
	l.mu.Lock()
	for _, n := range names {
		l.pins[n]++
	}
	l.mu.Unlock()
	l.poke()
	return func() {
		l.mu.Lock()
		for _, n := range names {
			if l.pins[n]--; l.pins[n] <= 0 {
				delete(l.pins, n)
			}
		}
		l.mu.Unlock()
		l.poke()
	}
}

// devices are the names of the claim's devices in the node's pool.
func (l *lazyMIG) devices(c *resourceapi.ResourceClaim) []string {
	if c == nil || c.Status.Allocation == nil {
		return nil
	}
	var out []string
	for _, r := range c.Status.Allocation.Devices.Results {
		if r.Driver == slices.DriverName && r.Pool == l.node {
			out = append(out, r.Device)
		}
	}
	return out
}

// start reads what the node's slices publish now (a restart, an upgrade
// from publishing every partition), so that the first decision withdraws
// nothing without its grace.
func (l *lazyMIG) start(ctx context.Context, inv *inventory.Inventory) error {
	shown, err := l.shown(ctx, inv)
	if err != nil {
		return err
	}
	l.mu.Lock()
	l.last = shown
	l.mu.Unlock()
	return nil
}

// shown reads the node's slices: the GPUs whose partitions the API
// publishes, and since when each carries the withdrawal taint.
func (l *lazyMIG) shown(ctx context.Context, inv *inventory.Inventory) (map[string]lazymig.State, error) {
	list, err := l.client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: "spec.driver=" + slices.DriverName + ",spec.nodeName=" + l.node})
	if err != nil {
		return nil, fmt.Errorf("list the node's slices: %w", err)
	}
	var gen int64
	for _, s := range list.Items {
		if s.Spec.Pool.Name == l.node {
			gen = max(gen, s.Spec.Pool.Generation)
		}
	}
	out := map[string]lazymig.State{}
	for _, s := range list.Items {
		if s.Spec.Pool.Name != l.node || s.Spec.Pool.Generation != gen {
			continue
		}
		for _, d := range s.Spec.Devices {
			dev, ok := inv.Lookup(d.Name)
			if !ok || dev.Kind != inventory.Partition {
				continue
			}
			st := out[dev.GPU.Name()]
			st.Open = true
			for _, t := range d.Taints {
				if t.Key == lazymig.TaintKey && t.TimeAdded != nil && (st.Closing.IsZero() || t.TimeAdded.Before(&metav1.Time{Time: st.Closing})) {
					st.Closing = t.TimeAdded.UTC()
				}
			}
			out[dev.GPU.Name()] = st
		}
	}
	return out, nil
}

// decide says what to publish now. unhealthy names the GPUs with health
// taints.
func (l *lazyMIG) decide(ctx context.Context, inv *inventory.Inventory, unhealthy func(gpu string) bool) (lazymig.Decision, error) {
	held, err := l.claims.Snapshot(ctx)
	if err != nil {
		return lazymig.Decision{}, fmt.Errorf("read the prepared claims: %w", err)
	}
	partitioned, whole := map[string]bool{}, map[string]bool{}
	mark := func(name string, exclusive bool) {
		dev, ok := inv.Lookup(name)
		switch {
		case !ok:
		case dev.Kind == inventory.Partition:
			partitioned[dev.GPU.Name()] = true
		case dev.Kind == inventory.Whole && exclusive:
			whole[dev.GPU.Name()] = true
		}
	}
	for _, c := range held {
		for _, d := range c.Devices {
			if d.Pool != l.node {
				continue
			}
			mark(d.Device, !d.AdminAccess && d.ShareID == "")
			if d.MIG != nil {
				// A partition recorded under a name this inventory does
				// not know still holds its GPU.
				for _, g := range inv.CounterSets {
					if g.UUID == d.MIG.GPUUUID {
						partitioned[g.Name()] = true
					}
				}
			}
		}
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	for name := range l.pins {
		// A prepare in flight holds a partition already; a whole GPU's
		// partitions stay until the checkpoint says it is held exclusively.
		mark(name, false)
	}
	var gpus []lazymig.GPU
	for _, g := range switchable(inv) {
		gpus = append(gpus, lazymig.GPU{Name: g, Partitioned: partitioned[g], WholeHeld: whole[g], Unhealthy: unhealthy(g), Published: l.last[g]})
	}
	now := l.clock.Now()
	d := lazymig.Decide(gpus, l.policy, now)
	if withdrawn := l.expired(gpus, d); len(withdrawn) > 0 {
		// Withdraw only what the API has shown tainted for the grace.
		shown, err := l.shown(ctx, inv)
		if err != nil {
			return lazymig.Decision{}, fmt.Errorf("check the withdrawal taints before withdrawing partitions: %w", err)
		}
		recheck := false
		for i, g := range gpus {
			if !withdrawn[g.Name] {
				continue
			}
			s := shown[g.Name]
			if s.IsClosing() && !now.Before(s.Closing.Add(l.policy.Grace)) {
				continue
			}
			recheck = true
			if s.IsClosing() {
				gpus[i].Published = s // the countdown the scheduler saw
			} else {
				// Not shown yet: keep the taint, count from now.
				gpus[i].Published = lazymig.State{Open: true, Closing: now.Round(time.Second).UTC()}
			}
			klog.FromContext(ctx).V(2).Info("Not withdrawing a GPU's partitions yet: the API has not shown their taint for the grace period", "gpu", g.Name, "shown", s)
		}
		if recheck {
			d = lazymig.Decide(gpus, l.policy, now)
		}
	}
	l.last = d.States
	return d, nil
}

// expired names the free GPUs whose partitions were published being
// withdrawn and that d withdraws.
func (l *lazyMIG) expired(gpus []lazymig.GPU, d lazymig.Decision) map[string]bool {
	out := map[string]bool{}
	for _, g := range gpus {
		if _, kept := d.States[g.Name]; !kept && g.Published.IsClosing() && !g.WholeHeld {
			out[g.Name] = true
		}
	}
	return out
}

// switchable names the GPUs that offer both their whole device and their
// partitions, in index order: the GPUs lazy publishing applies to.
func switchable(inv *inventory.Inventory) []string {
	var out []string
	for _, g := range inv.CounterSets {
		if g.MIGSwitchable {
			out = append(out, g.Name())
		}
	}
	return out
}

// lazyRetry is how soon a failed decision (the checkpoint or the API
// unreadable) is tried again; until then nothing changes.
const lazyRetry = 5 * time.Second

// lazyMIGApplies says whether the node has GPUs lazy publishing applies to.
func lazyMIGApplies(inv *inventory.Inventory) bool { return len(switchable(inv)) > 0 }

// after (re)arms t to fire in d, returning it and its channel.
func (l *lazyMIG) after(t clock.Timer, d time.Duration) (clock.Timer, <-chan time.Time) {
	d = max(d, 0)
	if t == nil {
		t = l.clock.NewTimer(d)
	} else {
		t.Stop()
		t.Reset(d)
	}
	return t, t.C()
}

// decideFor is the publish loop's decision, given the health taints; the
// first one starts from what the API publishes now.
func (l *lazyMIG) decideFor(ctx context.Context, inv *inventory.Inventory, taints map[string][]resourceapi.DeviceTaint) (lazymig.Decision, error) {
	if !l.started {
		if err := l.start(ctx, inv); err != nil {
			return lazymig.Decision{}, err
		}
		l.started = true
	}
	return l.decide(ctx, inv, func(gpu string) bool { return len(taints[gpu]) > 0 })
}
