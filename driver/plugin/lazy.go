package plugin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"sync"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"

	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/inventory"
	"github.com/tessera-dev/tessera/driver/lazymig"
	"github.com/tessera-dev/tessera/driver/prepare"
	"github.com/tessera-dev/tessera/driver/slices"
)

// lazyMIG feeds driver/lazymig for the publish loop. What the node holds is
// the checkpoint (from disk in a rolling update), the prepares in flight
// (pins) and, before every withdrawal, the claims the API server has
// allocated on the node, prepared or not. What is published is
// what this instance published last, joined with what the API shows (a
// watch of the node's slices): partitions another instance published (a
// rolling update) count as published, so they too are withdrawn only
// through the taint and the grace.
//
// The safety rules, on top of driver/lazymig's:
//   - At start, what the API publishes counts as published (so a restart
//     goes on with the countdowns the API shows), every partition if the
//     pool is being rewritten, and a GPU with a partition a claim in the
//     API is allocated counts as partitioned. The kubelet deletes a node's
//     slices when it restarts and when the plugin has been gone for a
//     while: the scheduler allocates nothing from them then, and what was
//     allocated before is in the claims.
//   - A free GPU's partitions are withdrawn only if the API has shown them
//     tainted for the whole grace and no claim in the API is allocated one
//     of them: a claim allocated but not prepared (its pod waits for a
//     volume, or tolerates the taint) keeps its GPU published.
//   - When a decision fails, the last one stands: nothing is withdrawn.
type lazyMIG struct {
	policy lazymig.Policy
	clock  clock.WithTicker
	client kubernetes.Interface
	node   string
	claims *prepare.Manager
	// wake asks the publish loop to decide again at once (the node's
	// slices changed in the API, a timer is due); held asks it to decide
	// again when its pace allows (a prepare began or ended, a claim was
	// unprepared). One pending wake of each is enough.
	wake, held chan struct{}
	// sliceInformer watches the node's slices; nil until watch starts.
	sliceInformer cache.SharedIndexInformer

	mu sync.Mutex
	// pins counts the prepares in flight per device name: their devices
	// are held before the checkpoint says so.
	pins map[string]int

	// The publish loop's own (one goroutine):
	// last is what it published last, by GPU name; nil before the first
	// decision.
	last map[string]lazymig.State
	// seen is when the API was first seen showing a GPU's partitions all
	// tainted, without a break since; a countdown starts no earlier (the
	// taint's own time is when the plugin decided, and its write may have
	// been late). Which stamp the taint carries does not matter to the
	// scheduler, only that one is there: a re-stamp (ours, or another
	// instance's) keeps the sighting. It is dropped when a decision sees
	// the GPU untainted, and when this instance withdraws or reopens the
	// GPU (wakes are coalesced: a decision may never see that land before
	// the GPU is tainted again, by this instance or another). taint is the stamp last
	// seen or written, which a restart checks its record against.
	seen map[string]seenTaint
	// reopened is, by GPU, the stamp of the taint this instance took off
	// (reopening the GPU) while the API may still show it.
	reopened map[string]time.Time
	// saved is seen as the marker file holds it.
	saved map[string]seenTaint
	// withdrew names the GPUs whose partitions this instance withdrew while
	// the API may still show them, tainted: that is the write on its way.
	withdrew map[string]lazymig.State
	// listFailed is when listing the claims last failed; it is not tried
	// again before listBackoff has passed.
	listFailed time.Time
	// ranBefore: the plugin's data directory held files at start.
	ranBefore bool
	// marker is a file in the plugin's data directory: present, the node
	// published before (so an empty pool in the API was deleted, not
	// never written); it holds seen, so that a restart keeps it.
	marker string
}

// ranBefore says a plugin ran on this node before (its data directory had
// files): with no marker, it published every partition.
func newLazyMIG(policy lazymig.Policy, clk clock.WithTicker, client kubernetes.Interface, node string, claims *prepare.Manager, marker string, ranBefore bool) *lazyMIG {
	return &lazyMIG{policy: policy, clock: clk, client: client, node: node, claims: claims, wake: make(chan struct{}, 1), held: make(chan struct{}, 1), pins: map[string]int{},
		seen: map[string]seenTaint{}, reopened: map[string]time.Time{}, withdrew: map[string]lazymig.State{}, marker: marker, ranBefore: ranBefore}
}

// poke asks for a new decision now.
func (l *lazyMIG) poke() { signal(l.wake) }

// heldChanged asks for a new decision because what the node holds changed:
// the publish loop paces these (Options.MIGPublishInterval).
func (l *lazyMIG) heldChanged() { signal(l.held) }

// signal leaves one wake pending on c.
func signal(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

// watch starts watching the node's slices until ctx ends; every change asks
// for a decision.
func (l *lazyMIG) watch(ctx context.Context) error {
	factory := informers.NewSharedInformerFactoryWithOptions(l.client, 0, informers.WithTweakListOptions(func(o *metav1.ListOptions) {
		o.FieldSelector = "spec.driver=" + slices.DriverName + ",spec.nodeName=" + l.node
	}))
	inf := factory.Resource().V1().ResourceSlices().Informer()
	poke := func(any) { l.poke() }
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: poke, UpdateFunc: func(_, o any) { l.poke() }, DeleteFunc: poke}); err != nil {
		return fmt.Errorf("watch the node's slices: %w", err)
	}
	l.sliceInformer = inf
	factory.Start(ctx.Done())
	go func() {
		<-ctx.Done()
		factory.Shutdown()
	}()
	return nil
}

// pin holds the node's devices a claim was allocated while it is prepared,
// so that no decision withdraws their GPU's partitions meanwhile; the
// returned func releases them. Both ask for a new decision (paced).
func (l *lazyMIG) pin(c *resourceapi.ResourceClaim) func() {
	names := l.devices(c)
	l.mu.Lock()
	for _, n := range names {
		l.pins[n]++
	}
	l.mu.Unlock()
	l.heldChanged()
	return func() {
		l.mu.Lock()
		for _, n := range names {
			if l.pins[n]--; l.pins[n] <= 0 {
				delete(l.pins, n)
			}
		}
		l.mu.Unlock()
		l.heldChanged()
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

// shown is what the API shows of the node's pool (its newest generation):
// by GPU, whether its partitions are published, and, when every one of them
// carries the withdrawal taint, the latest time the taint says it was
// added. complete says whether that generation's slices are all there (a
// pool being rewritten is not).
func (l *lazyMIG) shown(inv *inventory.Inventory) (_ map[string]lazymig.State, complete bool) {
	var objs []*resourceapi.ResourceSlice
	var gen int64
	for _, o := range l.sliceInformer.GetStore().List() {
		if s, ok := o.(*resourceapi.ResourceSlice); ok && s.Spec.Pool.Name == l.node {
			objs = append(objs, s)
			gen = max(gen, s.Spec.Pool.Generation)
		}
	}
	published, tainted := map[string]int{}, map[string]int{}
	since := map[string]time.Time{}
	var count, want int64
	for _, s := range objs {
		if s.Spec.Pool.Generation != gen {
			continue
		}
		count++
		want = s.Spec.Pool.ResourceSliceCount
		for _, d := range s.Spec.Devices {
			dev, ok := inv.Lookup(d.Name)
			if !ok || dev.Kind != inventory.Partition {
				continue
			}
			g := dev.GPU.Name()
			published[g]++
			for _, t := range d.Taints {
				if t.Key == lazymig.TaintKey && t.TimeAdded != nil {
					tainted[g]++
					if t.TimeAdded.After(since[g]) {
						since[g] = t.TimeAdded.UTC()
					}
					break
				}
			}
		}
	}
	out := map[string]lazymig.State{}
	for g, n := range published {
		st := lazymig.State{Open: true}
		if tainted[g] == n {
			st.Closing = since[g]
		}
		out[g] = st
	}
	return out, count == want
}

// showsOwn says whether the API shows exactly what this instance last
// decided (its own write seen, or nothing new): then a wake from the
// node's slices brings no news, and the publish loop may pace it like a
// change of what the node holds. Before the first decision nothing is its
// own.
func (l *lazyMIG) showsOwn(inv *inventory.Inventory) bool {
	if l.last == nil {
		return false
	}
	shown, complete := l.shown(inv)
	if !complete || len(shown) != len(l.last) {
		return false
	}
	for g, s := range l.last {
		if t, ok := shown[g]; !ok || !sameState(s, t) {
			return false
		}
	}
	return true
}

// allocatedInAPI lists the claims the API server has allocated a partition
// of this node, prepared or not, and names their GPUs.
// After a failure it is not tried again for listBackoff: every node asks
// for every claim, which is what an overloaded API server needs least.
func (l *lazyMIG) allocatedInAPI(ctx context.Context, inv *inventory.Inventory) (map[string]bool, error) {
	if !l.listFailed.IsZero() && l.clock.Since(l.listFailed) < listBackoff {
		return nil, fmt.Errorf("list the allocated claims: failed %v ago, trying again after %v", l.clock.Since(l.listFailed).Round(time.Second), listBackoff)
	}
	out := map[string]bool{}
	opts := metav1.ListOptions{Limit: 500}
	for {
		list, err := l.client.ResourceV1().ResourceClaims(metav1.NamespaceAll).List(ctx, opts)
		if err != nil {
			l.listFailed = l.clock.Now()
			return nil, fmt.Errorf("list the allocated claims: %w", err)
		}
		for i := range list.Items {
			for _, name := range l.devices(&list.Items[i]) {
				if dev, ok := inv.Lookup(name); ok && dev.Kind == inventory.Partition {
					out[dev.GPU.Name()] = true
				}
			}
		}
		if list.Continue == "" {
			l.listFailed = time.Time{}
			return out, nil
		}
		opts.Continue = list.Continue
	}
}

// decideFor is the publish loop's decision, given the health taints.
func (l *lazyMIG) decideFor(ctx context.Context, inv *inventory.Inventory, taints map[string][]resourceapi.DeviceTaint) (lazymig.Decision, error) {
	// Waits on the informer's own signal: WaitForCacheSync polls every
	// 100 ms, which every start paid before its first publish.
	if !cache.WaitFor(ctx, "", l.sliceInformer.HasSyncedChecker()) {
		return lazymig.Decision{}, fmt.Errorf("watch the node's slices: %w", context.Cause(ctx))
	}
	gpus := slices.LazyGPUs(inv)
	last, allocated := l.last, map[string]bool(nil)
	if last == nil {
		// At start: what the API publishes counts as published; all of
		// it if the pool is being rewritten, or was deleted (the kubelet
		// deletes a node's slices when it restarts, and the scheduler may
		// still hold allocations it made from them, unwritten); and a
		// claim allocated on the node holds its GPU, prepared or not.
		var err error
		if allocated, err = l.allocatedInAPI(ctx, inv); err != nil {
			return lazymig.Decision{}, err
		}
		shown, complete := l.shown(inv)
		if len(shown) == 0 && complete {
			// A node that never published; one that ran without the
			// marker published every partition (LazyMIG off, or a
			// release without it), and the scheduler may hold
			// allocations it made from them.
			_, err := os.Stat(l.marker)
			complete = errors.Is(err, fs.ErrNotExist) && !l.ranBefore
		}
		last = map[string]lazymig.State{}
		remembered := l.loadSeen(ctx)
		for _, g := range gpus {
			if s, ok := shown[g]; ok {
				last[g] = s
				if s.IsClosing() {
					// A restart goes on with the countdown its
					// predecessor saw; a taint it has no record of
					// (written by another instance, or before records
					// were kept) counts from now.
					seen, ok := remembered[g]
					if !ok || !seen.taint.Equal(s.Closing) {
						seen = seenTaint{taint: s.Closing, at: l.clock.Now()}
					}
					l.seen[g] = seen
				}
			} else if !complete {
				last[g] = lazymig.State{Open: true}
			}
		}
	}
	d, in, err := l.decide(ctx, inv, gpus, last, allocated, func(gpu string) bool { return len(taints[gpu]) > 0 })
	if err != nil {
		return lazymig.Decision{}, err
	}
	if withdrawn := expired(in, d); len(withdrawn) > 0 {
		// Withdraw only what the API has shown tainted for the whole
		// grace, and no claim in the API holds.
		allocated, err := l.allocatedInAPI(ctx, inv)
		if err != nil {
			return lazymig.Decision{}, fmt.Errorf("check the node's claims before withdrawing partitions: %w", err)
		}
		shown, _ := l.shown(inv)
		now := l.clock.Now()
		recheck := false
		for i, g := range in {
			if !withdrawn[g.Name] {
				continue
			}
			s := shown[g.Name]
			switch {
			case !s.IsClosing():
				// The API does not show the taint yet: keep it and count
				// from when it is first seen.
				in[i].Published = lazymig.State{Open: true, Closing: now.Round(time.Second).UTC()}
			case allocated[g.Name]:
				// A claim holds one (its pod not started yet): count
				// again from now. The partitions carry a taint without a
				// break, so the new stamp's countdown is its own time.
				restamp := ceilSecond(now)
				in[i].Published = lazymig.State{Open: true, Closing: restamp}
				l.seen[g.Name] = seenTaint{taint: restamp, at: restamp}
			case now.Before(l.countdown(g.Name, s, now).Add(l.policy.Grace)):
				// The countdown the scheduler saw, written as the taint's
				// time; it is that taint's countdown when seen (else the
				// stamp, seen a moment later each time, would move on
				// forever and the GPU never be withdrawn).
				c := l.countdown(g.Name, s, now)
				in[i].Published = lazymig.State{Open: true, Closing: c}
				at := l.seen[g.Name].at
				if at.IsZero() {
					at = c // first seen only now, by the check
				}
				l.seen[g.Name] = seenTaint{taint: c, at: at}
			default:
				continue
			}
			recheck = true
			klog.FromContext(ctx).V(2).Info("Not withdrawing a GPU's partitions yet", "gpu", g.Name, "allocatedInAPI", allocated[g.Name], "shown", s)
		}
		if recheck {
			d = lazymig.Decide(in, l.policy, now)
		}
	}
	for _, g := range in {
		if _, kept := d.States[g.Name]; !kept && g.Published.Open {
			l.withdrew[g.Name] = g.Published
			delete(l.seen, g.Name) // its countdown is over
		}
	}
	for _, g := range in {
		if st, kept := d.States[g.Name]; kept && !st.IsClosing() && g.Published.IsClosing() {
			// Reopened (a prepare): published untainted now. A later
			// taint is a new one, and until this lands the API's old
			// taint is no sighting of it.
			delete(l.seen, g.Name)
			l.reopened[g.Name] = g.Published.Closing
		}
	}
	for g := range d.States {
		delete(l.withdrew, g)
	}
	if l.last == nil || !maps.Equal(l.saved, l.seen) {
		// On disk before the first lazy publish: a restart that then finds
		// no slices must not take the node for a new one. It holds when
		// each withdrawal taint was first seen, so that a restart does not
		// count a grace from a stamp the scheduler saw later.
		if err := l.saveSeen(); err != nil {
			if l.last == nil {
				return lazymig.Decision{}, fmt.Errorf("mark the node as published lazily: %w", err)
			}
			// The marker is there; a stale record only makes a restart
			// count a taint from later. Deciding on matters more.
			klog.FromContext(ctx).Error(err, "Keeping the withdrawal taints' first sightings failed; a restart counts them from then", "file", l.marker)
		}
	}
	l.last = d.States
	return d, nil
}

// seenRecord is a first sighting as the marker file keeps it.
type seenRecord struct {
	Taint time.Time `json:"taint"`
	At    time.Time `json:"firstSeen"`
}

// saveSeen writes the marker file with the first sightings of the
// withdrawal taints shown now.
func (l *lazyMIG) saveSeen() error {
	records := make(map[string]seenRecord, len(l.seen))
	for g, s := range l.seen {
		records[g] = seenRecord{Taint: s.taint, At: s.at}
	}
	data, err := json.Marshal(records)
	if err != nil {
		return err
	}
	if err := checkpoint.WriteFileAtomic(l.marker, data, 0o600); err != nil {
		return err
	}
	l.saved = maps.Clone(l.seen)
	return nil
}

// loadSeen reads the first sightings the marker file keeps. An empty file
// (written before sightings were kept), a missing or an unreadable one
// yields none: every taint shown then counts from now.
func (l *lazyMIG) loadSeen(ctx context.Context) map[string]seenTaint {
	out := map[string]seenTaint{}
	data, err := os.ReadFile(l.marker)
	if err != nil || len(data) == 0 {
		return out
	}
	var records map[string]seenRecord
	if err := json.Unmarshal(data, &records); err != nil {
		klog.FromContext(ctx).Error(err, "Ignoring the withdrawal taints' first sightings; every taint shown counts from now", "file", l.marker)
		return out
	}
	for g, r := range records {
		out[g] = seenTaint{taint: r.Taint, at: r.At}
	}
	return out
}

// countdown is when the countdown of a GPU whose partitions the API shows
// tainted (s) began: the taint's time, or, if the API was first seen
// showing it more than a second later, then; a taint not seen before (the
// API changed since the decision looked) counts from now.
func (l *lazyMIG) countdown(gpu string, s lazymig.State, now time.Time) time.Time {
	seen, ok := l.seen[gpu]
	switch {
	case !ok:
		return ceilSecond(now)
	case seen.at.After(s.Closing.Add(time.Second)):
		return ceilSecond(seen.at)
	}
	return s.Closing
}

// ceilSecond is t rounded up to the second a taint's time is written in:
// never before t, and, for a sighting more than a second after a stamp,
// at least two seconds after it, which the upstream slice controller (it
// takes taint times within a second as equal) does write.
func ceilSecond(t time.Time) time.Time {
	if c := t.Truncate(time.Second); !c.Equal(t) {
		return c.Add(time.Second).UTC()
	}
	return t.UTC()
}

// seenTaint is when a GPU's withdrawal taint was first seen in the API, and
// the stamp it carries now.
type seenTaint struct{ taint, at time.Time }

// decide gathers Decide's input and decides once.
// alsoHeld names GPUs held besides what the node prepared.
func (l *lazyMIG) decide(ctx context.Context, inv *inventory.Inventory, gpus []string, last map[string]lazymig.State, alsoHeld map[string]bool, unhealthy func(gpu string) bool) (lazymig.Decision, []lazymig.GPU, error) {
	// Pins first: a prepare that ends in between is then in the
	// checkpoint read after.
	l.mu.Lock()
	pins := maps.Clone(l.pins)
	l.mu.Unlock()
	held, err := l.claims.Snapshot(ctx)
	if err != nil {
		return lazymig.Decision{}, nil, fmt.Errorf("read the prepared claims: %w", err)
	}
	partitioned, whole := maps.Clone(alsoHeld), map[string]bool{}
	if partitioned == nil {
		partitioned = map[string]bool{}
	}
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
	pinned := map[string]bool{}
	for name := range pins {
		// A prepare in flight keeps its partition's GPU open, but moves
		// no spare until the checkpoint says the partition is held
		// (lazymig.GPU.Pinned); a whole GPU's partitions stay until the
		// checkpoint says it is held.
		if dev, ok := inv.Lookup(name); ok && dev.Kind == inventory.Partition {
			pinned[dev.GPU.Name()] = true
		}
	}
	shown, _ := l.shown(inv)
	now := l.clock.Now()
	in := make([]lazymig.GPU, 0, len(gpus))
	for _, g := range gpus {
		pub, s := last[g], shown[g]
		if r, ok := l.reopened[g]; ok && !(s.IsClosing() && r.Equal(s.Closing)) {
			delete(l.reopened, g) // our reopening has landed, or more since
		}
		_, stale := l.reopened[g]
		switch seen, ok := l.seen[g]; {
		case !s.IsClosing():
			delete(l.seen, g)
		case stale:
			// The taint this instance took off, not yet gone from the
			// API: no sighting of a taint to come.
		case !ok:
			l.seen[g] = seenTaint{taint: s.Closing, at: now}
		case !seen.taint.Equal(s.Closing):
			l.seen[g] = seenTaint{taint: s.Closing, at: seen.at}
		}
		if !s.Open {
			delete(l.withdrew, g) // our withdrawal has landed
		}
		switch {
		case !s.Open, sameState(l.withdrew[g], s):
			// Nothing shown, or what we withdrew, still on its way out (a
			// taint stamped otherwise is another instance's, news).
		case !pub.Open:
			// Published by another instance (a rolling update): withdraw
			// it only through the taint and the grace, as if ours.
			pub = s
		case pub.IsClosing() && s.IsClosing():
			// Two instances' stamps: take the API's, or they would
			// rewrite each other's.
			pub.Closing = s.Closing
		}
		in = append(in, lazymig.GPU{Name: g, Partitioned: partitioned[g], Pinned: pinned[g], WholeHeld: whole[g], Unhealthy: unhealthy(g), Published: pub})
	}
	return lazymig.Decide(in, l.policy, l.clock.Now()), in, nil
}

// sameState compares two published states by instant, not by how their
// times were made (a parsed time and a computed one differ in ==).
func sameState(a, b lazymig.State) bool { return a.Open == b.Open && a.Closing.Equal(b.Closing) }

// expired names the free GPUs whose partitions were published being
// withdrawn and that d withdraws.
func expired(gpus []lazymig.GPU, d lazymig.Decision) map[string]bool {
	out := map[string]bool{}
	for _, g := range gpus {
		if _, kept := d.States[g.Name]; !kept && g.Published.IsClosing() && !g.WholeHeld {
			out[g.Name] = true
		}
	}
	return out
}

// lazyRetry is how soon a failed decision (the checkpoint or the API
// unreadable) is tried again; until then the last decision stands.
// listBackoff is how long listing the claims rests after a failure.
const (
	lazyRetry   = 5 * time.Second
	listBackoff = time.Minute
)

// lazyMIGApplies says whether the node has GPUs lazy publishing applies to.
func lazyMIGApplies(inv *inventory.Inventory) bool { return len(slices.LazyGPUs(inv)) > 0 }

// after (re)arms t to fire in d, returning it and its channel.
// A time already past (the clock moved while deciding) asks for a decision
// at once instead: a timer set for now may wait for the next tick of a
// clock that does not tick by itself.
func (l *lazyMIG) after(t clock.Timer, d time.Duration) (clock.Timer, <-chan time.Time) {
	if d <= 0 {
		l.poke()
		d = time.Hour // and keep t armed, to be reset
	}
	if t == nil {
		t = l.clock.NewTimer(d)
	} else {
		t.Stop()
		t.Reset(d)
	}
	return t, t.C()
}
