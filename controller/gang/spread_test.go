package gang

import (
	"fmt"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2/ktesting"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
)

const rackKey = "example.com/rack"

// spreadOver gives the view a Spread policy.
func spreadOver(v *view, key string, max int32, strength gangv1.Strength) *view {
	v.placement = &gangv1.Placement{Policy: gangv1.PolicySpread, TopologyKey: key, MaxPerValue: max, Strength: strength}
	return v
}

// perValue counts a plan's members per value of key.
func perValue(p *plan, nodes map[string]*v1.Node, key string) map[string]int {
	out := map[string]int{}
	for _, n := range p.nodes {
		out[nodes[n].Labels[key]]++
	}
	return out
}

// A Required spread takes the smallest domain where no value of the key
// gets more than K members, and holds the gang, saying what the spread
// left out, where none allows it.
func TestSearchSpreadsAtMostKMembersPerValue(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	snap, nodes := trays(t, map[string]uint32{"a1": 1, "b1": 2, "b2": 2, "b3": 2})
	for _, tc := range []struct {
		members int
		max     int32
		pool    string // "" when nothing fits
	}{
		{1, 1, poolOf(1)},
		{2, 2, poolOf(1)}, // two on one tray is within the limit
		{2, 1, poolOf(2)}, // packed, both would go on a1
		{3, 1, poolOf(2)},
		{4, 2, poolOf(2)},
		{4, 1, ""}, // four trays, but not in one clique
	} {
		p, verdicts, err := search(ctx, snap, driver, nodes, newCapacity(nodes, nil), spreadOver(gangOf(tc.members, 1), v1.LabelHostname, tc.max, gangv1.StrengthRequired))
		if err != nil {
			t.Fatal(err)
		}
		if tc.pool == "" {
			if p != nil {
				t.Errorf("%d members at most %d per node: placed in %s on %v, want no fit", tc.members, tc.max, p.pool, p.nodes)
			} else if msg := noFitMessage(tc.members, verdicts); !strings.Contains(msg, "spread allows at most 1 members per value of kubernetes.io/hostname, and 3 of its 3 values are at that limit") {
				t.Errorf("message %q does not say the spread is what is short", msg)
			}
			continue
		}
		if p == nil {
			t.Errorf("%d members at most %d per node: no fit (%s), want %s", tc.members, tc.max, noFitMessage(tc.members, verdicts), tc.pool)
			continue
		}
		if p.pool != tc.pool {
			t.Errorf("%d members at most %d per node: placed in %s, want %s", tc.members, tc.max, p.pool, tc.pool)
		}
		for n, k := range perValue(p, nodes, v1.LabelHostname) {
			if k > int(tc.max) {
				t.Errorf("%d members at most %d per node: %d on %s", tc.members, tc.max, k, n)
			}
		}
	}
}

// A Preferred spread is met where a domain allows it; where none does, the
// gang is placed anyway, in the domain that misses it least, as evenly as
// its nodes allow.
func TestAPreferredSpreadFallsBackToTheEvenestPlacement(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	snap, nodes := trays(t, map[string]uint32{"a1": 1, "b1": 2, "b2": 2, "b3": 2})
	p, _, err := search(ctx, snap, driver, nodes, newCapacity(nodes, nil), spreadOver(gangOf(3, 1), v1.LabelHostname, 1, gangv1.StrengthPreferred))
	if err != nil || p == nil {
		t.Fatalf("no fit: %v", err)
	}
	if got := perValue(p, nodes, v1.LabelHostname); p.pool != poolOf(2) || len(got) != 3 {
		t.Errorf("3 members, preferably one per node: %v in %s, want one on each tray of %s", got, p.pool, poolOf(2))
	}
	// Five one-GPU members, preferably one per node: no clique has five
	// trays. a1 fits them all on one node; the three-tray clique spreads
	// them 2-2-1, which misses the policy least.
	p, _, err = search(ctx, snap, driver, nodes, newCapacity(nodes, nil), spreadOver(gangOf(5, 1), v1.LabelHostname, 1, gangv1.StrengthPreferred))
	if err != nil || p == nil {
		t.Fatalf("a preferred spread held the gang: %v", err)
	}
	got := perValue(p, nodes, v1.LabelHostname)
	if p.pool != poolOf(2) || len(got) != 3 {
		t.Errorf("5 members: %v in %s, want them over the three trays of %s", got, p.pool, poolOf(2))
	}
	for n, k := range got {
		if k > 2 {
			t.Errorf("5 members over 3 trays: %d on %s, want at most 2", k, n)
		}
	}
	if msg := spreadNotMet(gangv1.Placement{Policy: gangv1.PolicySpread, TopologyKey: v1.LabelHostname, MaxPerValue: 1}, nodes, p.nodes); !strings.Contains(msg, "not met: 2 on kubernetes.io/hostname=") {
		t.Errorf("spreadNotMet = %q, want the two nodes of two members named", msg)
	}
	// Required, the same gang waits.
	if p, _, err := search(ctx, snap, driver, nodes, newCapacity(nodes, nil), spreadOver(gangOf(5, 1), v1.LabelHostname, 1, gangv1.StrengthRequired)); err != nil || p != nil {
		t.Errorf("a required spread of 5 members over at most 3 nodes placed them: %v, %v", p, err)
	}
}

// A Spread gang without a domain claim is not held to one domain when none
// has enough values: spreading over racks is the point of the policy.
// Nodes without the label are left out.
func TestASpreadGangWithoutADomainClaimMaySpanDomains(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	snap, nodes := trays(t, map[string]uint32{"a1": 1, "a2": 1, "b1": 2, "b2": 2, "c1": 3})
	// The racks are the cliques; c1 carries no rack label.
	for name, rack := range map[string]string{"a1": "r1", "a2": "r1", "b1": "r2", "b2": "r2"} {
		nodes[name].Labels[rackKey] = rack
	}
	v := spreadOver(gangOf(2, 1), rackKey, 1, gangv1.StrengthRequired)
	v.domainClaim = nil
	p, verdicts, err := search(ctx, snap, driver, nodes, newCapacity(nodes, nil), v)
	if err != nil || p == nil {
		t.Fatalf("no fit: %v %s", err, noFitMessage(2, verdicts))
	}
	if got := perValue(p, nodes, rackKey); p.pool != clusterPool || got["r1"] != 1 || got["r2"] != 1 {
		t.Errorf("placed in %s on %v (%v per rack), want one member in each rack across the cluster", p.pool, p.nodes, got)
	}
	// With a domain claim the gang is confined to one clique, which holds
	// one rack: it waits.
	p, _, err = search(ctx, snap, driver, nodes, newCapacity(nodes, nil), spreadOver(gangOf(2, 1), rackKey, 1, gangv1.StrengthRequired))
	if err != nil || p != nil {
		t.Errorf("a gang with a domain claim spread over two racks: %v, %v; want no fit", p, err)
	}
	// Three members over two labelled racks: c1's node is not used.
	v = spreadOver(gangOf(3, 1), rackKey, 1, gangv1.StrengthRequired)
	v.domainClaim = nil
	if p, _, err = search(ctx, snap, driver, nodes, newCapacity(nodes, nil), v); err != nil || p != nil {
		t.Errorf("3 members at most one per rack, two racks: placed on %v (%v)", p, err)
	}
}

// Through the reconciler: a Required spread pins the members to nodes of
// distinct values; a Preferred one that cannot be met is placed anyway and
// says so on its Placed condition.
func TestAPlacedSpreadGangPinsItsMembersApart(t *testing.T) {
	for _, tc := range []struct {
		strength gangv1.Strength
		members  int
		reason   string
	}{
		{gangv1.StrengthRequired, 3, gangv1.ReasonPlaced},
		{gangv1.StrengthPreferred, 5, gangv1.ReasonPolicyNotMet},
	} {
		t.Run(string(tc.strength), func(t *testing.T) {
			snap, nodes := trays(t, map[string]uint32{"a1": 1, "b1": 2, "b2": 2, "b3": 2})
			f := newFakeCluster(t, snap, nodes)
			f.gangMembers(tc.members, func(g *gangv1.Gang) {
				g.Spec.Placement = &gangv1.Placement{Policy: gangv1.PolicySpread, TopologyKey: v1.LabelHostname, MaxPerValue: 1, Strength: tc.strength}
			})
			if _, err := f.reconcile("ml", "g"); err != nil {
				t.Fatal(err)
			}
			perNode := map[string]int{}
			for i := range tc.members {
				perNode[pinnedTo(f.pod("ml", fmt.Sprintf("m-%d", i)))]++
			}
			if len(perNode) != 3 || perNode[""] != 0 || perNode["a1"] != 0 {
				t.Errorf("%d members pinned %v, want them over b1, b2 and b3", tc.members, perNode)
			}
			g := f.gang("ml", "g")
			c := meta.FindStatusCondition(g.Status.Conditions, gangv1.ConditionPlaced)
			if c == nil || c.Status != metav1.ConditionTrue || c.Reason != tc.reason {
				t.Fatalf("Placed condition %+v, want True/%s", c, tc.reason)
			}
			if tc.reason == gangv1.ReasonPolicyNotMet && !strings.Contains(c.Message, "preferred spread of at most 1 members per value of kubernetes.io/hostname not met") {
				t.Errorf("Placed message %q does not say the spread was not met", c.Message)
			}
			// The next reconcile (committed, members bound) keeps it so.
			for i := range tc.members {
				p := f.pod("ml", fmt.Sprintf("m-%d", i))
				p.Spec.NodeName = pinnedTo(p)
				if err := f.client.Tracker().Update(v1.SchemeGroupVersion.WithResource("pods"), p, "ml"); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := f.reconcile("ml", "g"); err != nil {
				t.Fatal(err)
			}
			if c := meta.FindStatusCondition(f.gang("ml", "g").Status.Conditions, gangv1.ConditionPlaced); c == nil || c.Reason != tc.reason {
				t.Errorf("after the members were bound, Placed condition %+v, want reason %s", c, tc.reason)
			}
		})
	}
}
