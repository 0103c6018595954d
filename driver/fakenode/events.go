package fakenode

import (
	"fmt"
	"sync"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

// The fake node's GPU faults live at the NVML boundary: tests inject XIDs and
// ECC errors that reach whoever registered for them through the ordinary
// event-set API (EventSetCreate, RegisterEvents, Wait), and a lost GPU answers
// GetUUID and GetMemoryInfo with ERROR_GPU_IS_LOST as real NVML does. The
// health code cannot tell this from a real node.

// supportedEvents are the event types every fake GPU can report.
const supportedEvents = nvml.EventTypeXidCriticalError | nvml.EventTypeDoubleBitEccError | nvml.EventTypeSingleBitEccError

// xidFallenOffBus is the XID the kernel driver logs when a GPU falls off the bus.
const xidFallenOffBus = 79

// events is a fake node's event source and fault state.
type events struct {
	devs []*server.Device

	mu          sync.Mutex
	sets        []*eventSet
	lost        map[int]bool
	unsupported map[int]bool
}

// eventSet is one nvml.EventSet: the devices and event types registered in it
// and a queue of events not yet waited for.
type eventSet struct {
	mock.EventSet
	mu         sync.Mutex
	registered map[int]uint64
	queue      []nvml.EventData
	ready      chan struct{} // closed and replaced when an event is queued
	freed      bool
}

// attachEvents installs the event API and the lost-GPU behaviour on a mock
// server and its devices.
func attachEvents(srv *server.Server, devs []*server.Device) *events {
	e := &events{devs: devs, lost: map[int]bool{}, unsupported: map[int]bool{}}
	srv.EventSetCreateFunc = e.create
	for i, d := range devs {
		i := i
		d.GetSupportedEventTypesFunc = func() (uint64, nvml.Return) {
			if e.isLost(i) {
				return 0, nvml.ERROR_GPU_IS_LOST
			}
			if e.isUnsupported(i) {
				return 0, nvml.ERROR_NOT_SUPPORTED
			}
			return supportedEvents, nvml.SUCCESS
		}
		d.RegisterEventsFunc = func(types uint64, set nvml.EventSet) nvml.Return {
			return e.register(i, types, set)
		}
		uuid, mem := d.GetUUIDFunc, d.GetMemoryInfoFunc
		d.GetUUIDFunc = func() (string, nvml.Return) {
			if e.isLost(i) {
				return "", nvml.ERROR_GPU_IS_LOST
			}
			return uuid()
		}
		d.GetMemoryInfoFunc = func() (nvml.Memory, nvml.Return) {
			if e.isLost(i) {
				return nvml.Memory{}, nvml.ERROR_GPU_IS_LOST
			}
			return mem()
		}
	}
	return e
}

func (e *events) create() (nvml.EventSet, nvml.Return) {
	s := &eventSet{registered: map[int]uint64{}, ready: make(chan struct{})}
	s.WaitFunc = s.wait
	s.FreeFunc = s.free
	e.mu.Lock()
	e.sets = append(e.sets, s)
	e.mu.Unlock()
	return s, nvml.SUCCESS
}

func (e *events) register(i int, types uint64, set nvml.EventSet) nvml.Return {
	switch {
	case e.isLost(i):
		return nvml.ERROR_GPU_IS_LOST
	case e.isUnsupported(i) || types&^supportedEvents != 0:
		return nvml.ERROR_NOT_SUPPORTED
	}
	s, ok := set.(*eventSet)
	if !ok {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.freed {
		return nvml.ERROR_UNINITIALIZED
	}
	s.registered[i] |= types
	return nvml.SUCCESS
}

func (s *eventSet) wait(timeoutMs uint32) (nvml.EventData, nvml.Return) {
	timer := time.NewTimer(time.Duration(timeoutMs) * time.Millisecond)
	defer timer.Stop()
	for {
		s.mu.Lock()
		if s.freed {
			s.mu.Unlock()
			return nvml.EventData{}, nvml.ERROR_UNINITIALIZED
		}
		if len(s.queue) > 0 {
			ev := s.queue[0]
			s.queue = s.queue[1:]
			s.mu.Unlock()
			return ev, nvml.SUCCESS
		}
		ready := s.ready
		s.mu.Unlock()
		select {
		case <-ready:
		case <-timer.C:
			return nvml.EventData{}, nvml.ERROR_TIMEOUT
		}
	}
}

func (s *eventSet) free() nvml.Return {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.freed = true
	close(s.ready)
	s.ready = make(chan struct{})
	return nvml.SUCCESS
}

// deliver queues an event in every set that registered the GPU for its type.
func (e *events) deliver(i int, eventType, data uint64) error {
	if i < 0 || i >= len(e.devs) {
		return fmt.Errorf("fake node has no gpu-%d", i)
	}
	e.mu.Lock()
	sets := append([]*eventSet(nil), e.sets...)
	e.mu.Unlock()
	for _, s := range sets {
		s.mu.Lock()
		if !s.freed && s.registered[i]&eventType != 0 {
			s.queue = append(s.queue, nvml.EventData{Device: e.devs[i], EventType: eventType, EventData: data})
			close(s.ready)
			s.ready = make(chan struct{})
		}
		s.mu.Unlock()
	}
	return nil
}

func (e *events) isLost(i int) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.lost[i]
}

func (e *events) isUnsupported(i int) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.unsupported[i]
}

func (e *events) set(m map[int]bool, i int, v bool) error {
	if i < 0 || i >= len(e.devs) {
		return fmt.Errorf("fake node has no gpu-%d", i)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	m[i] = v
	return nil
}

// InjectXID reports an XID critical error on a GPU, as the kernel driver
// would after logging "NVRM: Xid (PCI:...): <xid>".
func (n *Node) InjectXID(gpuIndex int, xid uint64) error {
	return n.events.deliver(gpuIndex, nvml.EventTypeXidCriticalError, xid)
}

// InjectECC reports a corrected (single-bit) or uncorrected (double-bit)
// memory error on a GPU.
func (n *Node) InjectECC(gpuIndex int, doubleBit bool) error {
	t := uint64(nvml.EventTypeSingleBitEccError)
	if doubleBit {
		t = nvml.EventTypeDoubleBitEccError
	}
	return n.events.deliver(gpuIndex, t, 0)
}

// LoseGPU makes a GPU fall off the bus: XID 79 is reported and NVML answers
// ERROR_GPU_IS_LOST for it until RecoverGPU.
func (n *Node) LoseGPU(gpuIndex int) error {
	if err := n.events.set(n.events.lost, gpuIndex, true); err != nil {
		return err
	}
	return n.events.deliver(gpuIndex, nvml.EventTypeXidCriticalError, xidFallenOffBus)
}

// RecoverGPU brings a lost GPU back, as a reset would.
func (n *Node) RecoverGPU(gpuIndex int) error {
	return n.events.set(n.events.lost, gpuIndex, false)
}

// DisableEvents makes a GPU refuse event registration (ERROR_NOT_SUPPORTED),
// as some boards and virtualised GPUs do.
func (n *Node) DisableEvents(gpuIndex int) error {
	return n.events.set(n.events.unsupported, gpuIndex, true)
}
