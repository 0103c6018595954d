//go:build faultinject

package prepare

import (
	"fmt"
	"slices"
	"sync"
)

// Crash is the value a failpoint panics with: the process "died" at Point.
// A test recovers it and abandons the Manager, as a real crash would.
type Crash struct{ Point string }

func (c Crash) String() string { return "crash at failpoint " + c.Point }

var armed struct {
	mu     sync.Mutex
	points map[string]bool
}

// Failpoints returns the names of every failure point (the registry,
// failpoint_names.go), in the order a claim's life reaches them.
func Failpoints() []string { return slices.Clone(failpoints) }

// ArmFailpoint makes the next pass through the named point panic with
// Crash. A point fires once: the restarted Manager runs clean. An unknown
// name panics, so a typo cannot make a test vacuous.
func ArmFailpoint(name string) {
	if !slices.Contains(failpoints, name) {
		panic(fmt.Sprintf("unknown failpoint %q; known: %v", name, failpoints))
	}
	armed.mu.Lock()
	defer armed.mu.Unlock()
	if armed.points == nil {
		armed.points = map[string]bool{}
	}
	armed.points[name] = true
}

// DisarmFailpoints disarms every point.
func DisarmFailpoints() {
	armed.mu.Lock()
	defer armed.mu.Unlock()
	clear(armed.points)
}

func failpoint(name string) {
	armed.mu.Lock()
	hit := armed.points[name]
	delete(armed.points, name)
	armed.mu.Unlock()
	if hit {
		panic(Crash{Point: name})
	}
}
