package gang

import (
	"fmt"
	"sort"
	"strings"

	v1 "k8s.io/api/core/v1"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
)

// layout is a Spread policy during one domain's fit: it orders the domain's
// nodes for each member by how many members the nodes of their topology
// value already hold, fewest first, and with hard set (Required) leaves out
// the nodes of values at the limit and nodes without the label. A nil
// layout packs.
type layout struct {
	key  string
	max  int
	hard bool
	// count is members placed per value (unlabelled for nodes without
	// the label).
	count map[string]int
}

// unlabelled keys the members on nodes without the topology label in
// layout.count (no label value can hold a NUL).
const unlabelled = "\x00"

// valueOf is node n's value of the layout's key, or unlabelled.
func (l *layout) valueOf(n *v1.Node) string {
	if val, ok := n.Labels[l.key]; ok {
		return val
	}
	return unlabelled
}

// newLayout is the layout of a gang's placement policy; nil for Pack.
func newLayout(pl gangv1.Placement, hard bool) *layout {
	if pl.Policy != gangv1.PolicySpread {
		return nil
	}
	return &layout{key: pl.TopologyKey, max: int(pl.MaxPerValue), hard: hard, count: map[string]int{}}
}

// fresh is an empty copy of l for another domain.
func (l *layout) fresh() *layout {
	if l == nil {
		return nil
	}
	return &layout{key: l.key, max: l.max, hard: l.hard, count: map[string]int{}}
}

// order is the indexes of usable to try for the next member. Packing, every
// node from the cursor on (where the previous member went). Spreading, the
// nodes of the least used values first, in cursor order within a value.
func (l *layout) order(usable []*v1.Node, cursor int) []int {
	idx := make([]int, 0, len(usable))
	for k := range usable {
		i := (cursor + k) % len(usable)
		if l != nil && l.hard {
			val := l.valueOf(usable[i])
			if val == unlabelled || l.count[val] >= l.max {
				continue
			}
		}
		idx = append(idx, i)
	}
	if l != nil {
		sort.SliceStable(idx, func(a, b int) bool {
			return l.count[l.valueOf(usable[idx[a]])] < l.count[l.valueOf(usable[idx[b]])]
		})
	}
	return idx
}

// take counts a member placed on n.
func (l *layout) take(n *v1.Node) {
	if l != nil {
		l.count[l.valueOf(n)]++
	}
}

// excess is how many members are past the limit of their value, counting
// every member on a node without the label.
func (l *layout) excess() int {
	e := 0
	for val, k := range l.count {
		switch {
		case val == unlabelled:
			e += k
		case k > l.max:
			e += k - l.max
		}
	}
	return e
}

// lacks says, for a member no node took, what the spread left out.
func (l *layout) lacks(usable []*v1.Node) string {
	if l == nil || !l.hard {
		return ""
	}
	values := map[string]bool{}
	without := 0
	for _, n := range usable {
		if val := l.valueOf(n); val != unlabelled {
			values[val] = true
		} else {
			without++
		}
	}
	full := 0
	for val := range values {
		if l.count[val] >= l.max {
			full++
		}
	}
	msg := fmt.Sprintf("; spread allows at most %d members per value of %s, and %d of its %d values are at that limit", l.max, l.key, full, len(values))
	if without > 0 {
		msg += fmt.Sprintf(" (%d nodes without the label are not used)", without)
	}
	return msg
}

// spreadNotMet says how a placement on these nodes misses the gang's Spread
// policy (members on nodes of one value past the limit, or on nodes without
// the label); "" when it meets it or the gang packs. Members without a node
// (no claims of their own) are not counted.
func spreadNotMet(pl gangv1.Placement, nodes map[string]*v1.Node, placed []string) string {
	if pl.Policy != gangv1.PolicySpread {
		return ""
	}
	count := map[string]int{}
	without := 0
	for _, name := range placed {
		n, ok := nodes[name]
		if name == "" || !ok {
			continue
		}
		if val, ok := n.Labels[pl.TopologyKey]; ok {
			count[val]++
		} else {
			without++
		}
	}
	var over []string
	for val, k := range count {
		if k > int(pl.MaxPerValue) {
			over = append(over, fmt.Sprintf("%d on %s=%s", k, pl.TopologyKey, val))
		}
	}
	sort.Strings(over)
	if without > 0 {
		over = append(over, fmt.Sprintf("%d on nodes without %s", without, pl.TopologyKey))
	}
	if len(over) == 0 {
		return ""
	}
	return fmt.Sprintf("preferred spread of at most %d members per value of %s not met: %s", pl.MaxPerValue, pl.TopologyKey, strings.Join(over, ", "))
}

// spreadNotMet says how the members' nodes miss the gang's preferred Spread
// policy; "" when they meet it (or the nodes cannot be listed).
func (r *reconciler) spreadNotMet(g *gangv1.Gang, placed []string) string {
	pl := gangv1.PlacementOf(&g.Spec)
	if pl.Policy != gangv1.PolicySpread {
		return ""
	}
	nodes := map[string]*v1.Node{}
	for _, name := range placed {
		if n, err := r.nodes.Get(name); err == nil {
			nodes[name] = n
		}
	}
	return spreadNotMet(pl, nodes, placed)
}
