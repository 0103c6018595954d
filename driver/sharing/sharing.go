// Package sharing holds an operator's choice of which GPUs independent
// claims share, and how: time slices or memory shares. It parses the
// plugin's flags and answers, per GPU, what the inventory should publish.
package sharing

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/tessera-dev/tessera/driver/discovery"
	"github.com/tessera-dev/tessera/driver/inventory"
)

// MaxTimeSlices bounds the slices one GPU is cut into.
const MaxTimeSlices = 64

// Policy says which GPUs are shared. The zero Policy shares nothing.
type Policy struct {
	timeSlices []rule
	memory     []selector
}

type rule struct {
	sel selector
	n   int
}

// selector matches GPUs: every GPU, one by index, or one by UUID.
type selector string

func (s selector) matches(g discovery.GPU) bool {
	return s == "all" || string(s) == strconv.Itoa(g.Index) || strings.EqualFold(string(s), g.UUID)
}

func parseSelector(flag, s string) (selector, error) {
	s = strings.TrimSpace(s)
	if s == "all" || strings.HasPrefix(s, "GPU-") {
		return selector(s), nil
	}
	if n, err := strconv.Atoi(s); err == nil && n >= 0 {
		return selector(s), nil
	}
	return "", fmt.Errorf("%s: GPU selector %q: want \"all\", a GPU index (0, 1, ...) or a GPU UUID (GPU-...)", flag, s)
}

// ParseTimeSliced reads --time-sliced-gpus: a comma-separated list of
// SELECTOR=SLICES (e.g. "all=4", "0=2,1=8", "GPU-8f6c...=3"), or a bare
// number for every GPU. The last rule matching a GPU wins. Empty: none.
func (p *Policy) ParseTimeSliced(value string) error {
	const flag = "--time-sliced-gpus"
	p.timeSlices = nil
	for _, item := range split(value) {
		sel, count, ok := strings.Cut(item, "=")
		if !ok {
			sel, count = "all", item
		}
		s, err := parseSelector(flag, sel)
		if err != nil {
			return err
		}
		n, err := strconv.Atoi(strings.TrimSpace(count))
		if err != nil || n < 2 || n > MaxTimeSlices {
			return fmt.Errorf("%s: %q: the number of slices must be between 2 and %d (e.g. all=4)", flag, item, MaxTimeSlices)
		}
		p.timeSlices = append(p.timeSlices, rule{sel: s, n: n})
	}
	return nil
}

// ParseMemoryShared reads --memory-shared-gpus: a comma-separated list of
// selectors ("all", "0,3", "GPU-..."). Empty: none.
func (p *Policy) ParseMemoryShared(value string) error {
	p.memory = nil
	for _, item := range split(value) {
		s, err := parseSelector("--memory-shared-gpus", item)
		if err != nil {
			return err
		}
		p.memory = append(p.memory, s)
	}
	return nil
}

// For says how claims share g.
func (p Policy) For(g discovery.GPU) inventory.Share {
	var s inventory.Share
	for _, r := range p.timeSlices {
		if r.sel.matches(g) {
			s.TimeSlices = r.n
		}
	}
	for _, sel := range p.memory {
		if sel.matches(g) {
			s.Memory = true
		}
	}
	return s
}

// Empty says whether no GPU is shared.
func (p Policy) Empty() bool { return len(p.timeSlices) == 0 && len(p.memory) == 0 }

func split(value string) []string {
	var out []string
	for _, item := range strings.Split(value, ",") {
		if item = strings.TrimSpace(item); item != "" {
			out = append(out, item)
		}
	}
	return out
}
