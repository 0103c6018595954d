package health

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"

	"github.com/tessera-dev/tessera/driver/discovery"
	"github.com/tessera-dev/tessera/driver/gpulib"
)

// watchedEvents are the NVML events the monitor registers for.
const watchedEvents = nvml.EventTypeXidCriticalError | nvml.EventTypeDoubleBitEccError | nvml.EventTypeSingleBitEccError

// Monitor watches every GPU of a node: one goroutine waits on an NVML event
// set and probes the GPUs between waits; the state machine turns both into
// per-device state, and every change goes to the subscribers.
type Monitor struct {
	lib     gpulib.Library
	opts    Options
	handles []nvml.Device // by GPU index; nil when NVML gave no handle

	mu        sync.Mutex
	machine   *machine
	subs      map[chan Snapshot]struct{}
	set       nvml.EventSet
	lastProbe time.Time
	// written is the state file's content as last read or written.
	written []byte
	done    chan struct{}
}

// New enumerates the node's GPUs through NVML, all of them, including those
// discovery could not describe (a lost GPU). gpus supply the UUIDs NVML may no
// longer tell.
func New(lib gpulib.Library, gpus []discovery.GPU, opts Options) (*Monitor, error) {
	opts = opts.withDefaults()
	count, ret := lib.DeviceGetCount()
	if err := gpulib.Error(ret); err != nil {
		return nil, fmt.Errorf("health: count GPUs: %w", err)
	}
	uuids := map[int]string{}
	for _, g := range gpus {
		uuids[g.Index] = g.UUID
	}
	mon := &Monitor{lib: lib, opts: opts, handles: make([]nvml.Device, count), subs: map[chan Snapshot]struct{}{}, done: make(chan struct{})}
	devices := make([]*device, count)
	for i := range devices {
		devices[i] = &device{index: i, name: discovery.GPU{Index: i}.Name(), uuid: uuids[i]}
		if h, ret := lib.DeviceGetHandleByIndex(i); ret == nvml.SUCCESS {
			mon.handles[i] = h
			if devices[i].uuid == "" {
				devices[i].uuid, _ = h.GetUUID()
			}
		}
	}
	mon.machine = newMachine(opts.QuietPeriod, opts.IgnoredXIDs, devices, opts.Clock.Now())
	return mon, nil
}

// Start restores the health state an earlier run saved (Options.StatePath),
// registers for every GPU's events, probes every GPU once (a GPU lost before
// the start is tainted before Start returns) and starts watching until ctx
// ends. Done is closed when the watcher has stopped.
func (mon *Monitor) Start(ctx context.Context) {
	logger := klog.FromContext(ctx)
	set, ret := mon.lib.EventSetCreate()
	if ret != nvml.SUCCESS {
		logger.Error(gpulib.Error(ret), "Cannot watch NVML events, GPU health is unknown")
		set = nil
	}
	mon.mu.Lock()
	mon.set = set
	now := mon.opts.Clock.Now()
	mon.restoreState(logger, now)
	for i := range mon.handles {
		if why := mon.register(i); why != "" {
			logger.Info("GPU events cannot be watched; marking it unmonitored", "device", mon.machine.devices[i].name, "reason", why)
			mon.machine.unmonitor(i, why, now)
		}
	}
	mon.mu.Unlock()
	mon.probeAll(ctx)
	go mon.run(ctx)
}

// Done is closed when the watcher has stopped and freed its event set.
func (mon *Monitor) Done() <-chan struct{} { return mon.done }

// State returns the current state of every GPU.
func (mon *Monitor) State() Snapshot {
	mon.mu.Lock()
	defer mon.mu.Unlock()
	return mon.machine.snapshot()
}

// Subscribe returns a channel that holds the current state at once and the
// latest state after every change (a slow reader skips to the newest), and a
// function that ends the subscription.
func (mon *Monitor) Subscribe() (<-chan Snapshot, func()) {
	ch := make(chan Snapshot, 1)
	mon.mu.Lock()
	defer mon.mu.Unlock()
	ch <- mon.machine.snapshot()
	mon.subs[ch] = struct{}{}
	return ch, func() {
		mon.mu.Lock()
		defer mon.mu.Unlock()
		delete(mon.subs, ch)
	}
}

// register adds GPU i to the event set and returns why it cannot, if so. The
// caller holds mu.
func (mon *Monitor) register(i int) string {
	h := mon.handles[i]
	switch {
	case mon.set == nil:
		return "event-set-failed"
	case h == nil:
		return "no-handle"
	}
	supported, ret := h.GetSupportedEventTypes()
	if ret != nvml.SUCCESS {
		return reason(ret)
	}
	if supported&nvml.EventTypeXidCriticalError == 0 {
		return "xid-not-supported"
	}
	if ret := h.RegisterEvents(watchedEvents&supported, mon.set); ret != nvml.SUCCESS {
		return reason(ret)
	}
	return ""
}

func reason(ret nvml.Return) string {
	switch ret {
	case nvml.ERROR_NOT_SUPPORTED:
		return "not-supported"
	case nvml.ERROR_GPU_IS_LOST:
		return "gpu-is-lost"
	}
	return fmt.Sprintf("nvml-error-%d", int(ret))
}

func (mon *Monitor) run(ctx context.Context) {
	logger := klog.FromContext(ctx)
	defer close(mon.done)
	defer func() {
		if mon.set != nil {
			mon.set.Free()
		}
	}()
	ms := uint32(mon.opts.WaitTimeout / time.Millisecond)
	for ctx.Err() == nil {
		ret := nvml.ERROR_UNINITIALIZED
		var ev nvml.EventData
		if mon.set != nil {
			ev, ret = mon.set.Wait(ms)
		}
		switch ret {
		case nvml.SUCCESS:
			mon.handle(ctx, ev)
		case nvml.ERROR_TIMEOUT:
		default:
			// No set, or NVML failed the wait: do not spin.
			logger.V(5).Info("NVML event wait failed", "err", gpulib.Error(ret))
			select {
			case <-ctx.Done():
			case <-time.After(mon.opts.WaitTimeout):
			}
		}
		if mon.opts.Clock.Since(mon.LastProbe()) >= mon.opts.ProbeInterval {
			mon.probeAll(ctx)
		}
	}
}

// LastProbe is when every GPU was last probed, by the monitor's clock.
func (mon *Monitor) LastProbe() time.Time {
	mon.mu.Lock()
	defer mon.mu.Unlock()
	return mon.lastProbe
}

// handle applies one NVML event.
func (mon *Monitor) handle(ctx context.Context, data nvml.EventData) {
	logger := klog.FromContext(ctx)
	i := mon.indexOf(data.Device)
	if i < 0 {
		logger.V(2).Info("NVML event for an unknown device, ignored", "type", data.EventType, "data", data.EventData)
		return
	}
	var ev event
	switch {
	case data.EventType&nvml.EventTypeXidCriticalError != 0:
		ev = event{kind: kindXID, xid: data.EventData}
	case data.EventType&nvml.EventTypeDoubleBitEccError != 0:
		ev = event{kind: kindDoubleBitECC}
	case data.EventType&nvml.EventTypeSingleBitEccError != 0:
		ev = event{kind: kindSingleBitECC}
	default:
		return
	}
	mon.mu.Lock()
	defer mon.mu.Unlock()
	d := mon.machine.devices[i]
	logger.Info("GPU health event", "device", d.name, "uuid", d.uuid, "kind", ev.kind, "xid", ev.xid)
	mon.opts.Metrics.count(d, ev)
	if mon.machine.observe(i, ev, mon.opts.Clock.Now()) {
		mon.notify()
	}
	mon.saveState(logger)
}

// indexOf finds an event's GPU by handle, else by UUID.
func (mon *Monitor) indexOf(dev nvml.Device) int {
	if dev == nil {
		return -1
	}
	for i, h := range mon.handles {
		if h == dev {
			return i
		}
	}
	if uuid, ret := dev.GetUUID(); ret == nvml.SUCCESS {
		for i, d := range mon.machine.devices {
			if d.uuid == uuid {
				return i
			}
		}
	}
	return -1
}

// probeAll asks every GPU for its UUID and memory: a GPU that answers is
// reachable; one that does not is tainted. Probes run without the lock (NVML
// may be slow); their results are applied together.
func (mon *Monitor) probeAll(ctx context.Context) {
	logger := klog.FromContext(ctx)
	errs := make([]error, len(mon.handles))
	for i, h := range mon.handles {
		errs[i] = probe(h)
	}
	mon.mu.Lock()
	defer mon.mu.Unlock()
	now := mon.opts.Clock.Now()
	mon.lastProbe = now
	changed := false
	for i, err := range errs {
		d := mon.machine.devices[i]
		if err == nil && d.unmonitored != "" && mon.set != nil && mon.register(i) == "" {
			// A GPU that came back can be watched again.
			logger.Info("GPU events are watched again", "device", d.name)
			mon.machine.monitor(i, now)
			changed = true
		}
		c, lost := mon.machine.probed(i, err, now)
		if lost {
			logger.Error(err, "GPU does not answer NVML; tainted", "device", d.name, "uuid", d.uuid)
			mon.opts.Metrics.count(d, event{kind: kindLost})
		} else if c && err == nil {
			logger.Info("GPU recovered: quiet and answering NVML; taints lifted", "device", d.name, "uuid", d.uuid)
		}
		changed = changed || c
	}
	if changed {
		mon.notify()
	}
	mon.saveState(logger)
	mon.opts.Metrics.set(mon.machine.snapshot())
}

func probe(h nvml.Device) error {
	if h == nil {
		return gpulib.Error(nvml.ERROR_GPU_IS_LOST)
	}
	if _, ret := h.GetUUID(); ret != nvml.SUCCESS {
		return fmt.Errorf("read UUID: %w", gpulib.Error(ret))
	}
	if _, ret := h.GetMemoryInfo(); ret != nvml.SUCCESS {
		return fmt.Errorf("read memory info: %w", gpulib.Error(ret))
	}
	return nil
}

// notify sends the current state to every subscriber, replacing a state the
// subscriber has not read yet. The caller holds mu.
func (mon *Monitor) notify() {
	snap := mon.machine.snapshot()
	mon.opts.Metrics.set(snap)
	for ch := range mon.subs {
		select {
		case <-ch:
		default:
		}
		ch <- snap
	}
}

// Clock is the monitor's time source.
func (mon *Monitor) Clock() clock.WithTicker { return mon.opts.Clock }
