package e2e

import (
	"fmt"
	"sort"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

// This file holds the tests' own account of who holds which hardware: from
// the published ResourceSlices alone, independent of the controller's and
// the scheduler's code, it says which allocated claims overlap (a device
// allocated to two claims, or a shared counter of a GPU drawn beyond what
// it has: a whole GPU beside one of its partitions, two partitions on the
// same memory slices).

// ledger is what the slices publish: each device's draws on shared
// counters, and each counter's capacity.
type ledger struct {
	devices  map[string]ledgerDevice      // "driver/pool/device"
	capacity map[string]resource.Quantity // "driver/pool/counterSet/counter"
}

type ledgerDevice struct {
	// multi: the device may be allocated to several claims at once.
	multi bool
	draws map[string]resource.Quantity // "driver/pool/counterSet/counter"
}

// newLedger reads the slices, only the newest generation of each pool.
func newLedger(slices []*resourceapi.ResourceSlice) *ledger {
	newest := map[string]int64{}
	for _, s := range slices {
		key := s.Spec.Driver + "/" + s.Spec.Pool.Name
		if g, ok := newest[key]; !ok || s.Spec.Pool.Generation > g {
			newest[key] = s.Spec.Pool.Generation
		}
	}
	l := &ledger{devices: map[string]ledgerDevice{}, capacity: map[string]resource.Quantity{}}
	for _, s := range slices {
		pool := s.Spec.Driver + "/" + s.Spec.Pool.Name
		if s.Spec.Pool.Generation != newest[pool] {
			continue
		}
		for _, set := range s.Spec.SharedCounters {
			for name, c := range set.Counters {
				l.capacity[pool+"/"+set.Name+"/"+name] = c.Value
			}
		}
		for _, d := range s.Spec.Devices {
			ld := ledgerDevice{multi: d.AllowMultipleAllocations != nil && *d.AllowMultipleAllocations, draws: map[string]resource.Quantity{}}
			for _, use := range d.ConsumesCounters {
				for name, c := range use.Counters {
					ld.draws[pool+"/"+use.CounterSet+"/"+name] = c.Value
				}
			}
			l.devices[pool+"/"+d.Name] = ld
		}
	}
	return l
}

// clash is hardware more than one claim holds.
type clash struct {
	// hw: the device ("driver/pool/device") or counter set
	// ("driver/pool/set", a GPU) held twice.
	hw string
	// what says which and how.
	what string
	// claims: "namespace/name" of every claim holding it, sorted.
	claims []string
}

func (c clash) key() string { return c.hw + " " + strings.Join(c.claims, ",") }

func (c clash) String() string {
	return fmt.Sprintf("%s held by claims %s", c.what, strings.Join(c.claims, ", "))
}

// clashes lists the overlaps among the allocated claims (admin access
// excepted, as the allocator does).
func (l *ledger) clashes(claims []*resourceapi.ResourceClaim) []clash {
	holders := map[string][]string{} // device -> claims
	drawers := map[string][]string{} // counter -> claims
	drawn := map[string]resource.Quantity{}
	for _, c := range claims {
		if c.Status.Allocation == nil {
			continue
		}
		name := c.Namespace + "/" + c.Name
		for _, r := range c.Status.Allocation.Devices.Results {
			if r.AdminAccess != nil && *r.AdminAccess {
				continue
			}
			dev := r.Driver + "/" + r.Pool + "/" + r.Device
			holders[dev] = append(holders[dev], name)
			for counter, q := range l.devices[dev].draws {
				sum := drawn[counter]
				sum.Add(q)
				drawn[counter] = sum
				drawers[counter] = append(drawers[counter], name)
			}
		}
	}
	var out []clash
	for dev, names := range holders {
		if len(names) > 1 && !l.devices[dev].multi {
			out = append(out, clash{hw: dev, what: "device " + dev, claims: sorted(names)})
		}
	}
	// One clash per counter set (a GPU): the counters it has overdrawn.
	over := map[string][]string{}   // "driver/pool/counterSet" -> counters
	overBy := map[string][]string{} // -> claims drawing on them
	for counter, sum := range drawn {
		if capacity, ok := l.capacity[counter]; ok && sum.Cmp(capacity) > 0 {
			set, name := counter[:strings.LastIndex(counter, "/")], counter[strings.LastIndex(counter, "/")+1:]
			over[set] = append(over[set], fmt.Sprintf("%s %s of %s", name, sum.String(), capacity.String()))
			overBy[set] = append(overBy[set], drawers[counter]...)
		}
	}
	for set, counters := range over {
		sort.Strings(counters)
		if len(counters) > 2 {
			counters = append(counters[:2], fmt.Sprintf("%d more", len(counters)-2))
		}
		out = append(out, clash{hw: set, what: fmt.Sprintf("counter set %s (drawn: %s)", set, strings.Join(counters, ", ")), claims: sorted(overBy[set])})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].key() < out[j].key() })
	return out
}

// sorted returns the distinct names, sorted.
func sorted(names []string) []string {
	set := map[string]bool{}
	var out []string
	for _, n := range names {
		if !set[n] {
			set[n] = true
			out = append(out, n)
		}
	}
	sort.Strings(out)
	return out
}
