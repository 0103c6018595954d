package lazymig

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

var (
	t0     = time.Date(2026, 12, 3, 8, 0, 0, 0, time.UTC)
	policy = Policy{Spares: 1, Grace: 15 * time.Minute}
)

func eight() []GPU {
	var out []GPU
	for i := range 8 {
		out = append(out, GPU{Name: fmt.Sprintf("gpu-%d", i)})
	}
	return out
}

// apply carries a decision over into what the API shows, as the slice
// controller would.
func apply(gpus []GPU, d Decision) {
	for i := range gpus {
		gpus[i].Published = d.States[gpus[i].Name]
	}
}

func TestAnEmptyNodePublishesTheLastGPUsPartitions(t *testing.T) {
	d := Decide(eight(), policy, t0)
	if want := []string{"gpu-7"}; !slices.Equal(d.Order, want) {
		t.Fatalf("published %v, want %v", d.Order, want)
	}
	if d.States["gpu-7"].IsClosing() || !d.Next.IsZero() {
		t.Fatalf("the spare is closing: %+v, next %v", d.States["gpu-7"], d.Next)
	}
	d = Decide(eight(), Policy{Spares: 3, Grace: time.Minute}, t0)
	if want := []string{"gpu-7", "gpu-6", "gpu-5"}; !slices.Equal(d.Order, want) {
		t.Fatalf("three spares: published %v, want %v", d.Order, want)
	}
}

func TestAPartitionedGPUOpensTheNextAndComesFirst(t *testing.T) {
	gpus := eight()
	apply(gpus, Decide(gpus, policy, t0))
	gpus[7].Partitioned = true
	d := Decide(gpus, policy, t0)
	if want := []string{"gpu-7", "gpu-6"}; !slices.Equal(d.Order, want) {
		t.Fatalf("published %v, want the partitioned gpu-7 first, then the spare gpu-6", d.Order)
	}
	// Whole GPUs taken from the lowest index do not move the spare.
	apply(gpus, d)
	gpus[0].WholeHeld, gpus[1].WholeHeld = true, true
	if d2 := Decide(gpus, policy, t0); !slices.Equal(d2.Order, d.Order) {
		t.Fatalf("whole GPUs held elsewhere moved the published GPUs: %v, then %v", d.Order, d2.Order)
	}
}

func TestAWholeHeldGPUsPartitionsGoAtOnce(t *testing.T) {
	gpus := eight()
	apply(gpus, Decide(gpus, policy, t0))
	gpus[7].WholeHeld = true
	d := Decide(gpus, policy, t0)
	if _, ok := d.States["gpu-7"]; ok {
		t.Fatalf("gpu-7 is held whole, but its partitions stay published: %+v", d.States)
	}
	if want := []string{"gpu-6"}; !slices.Equal(d.Order, want) {
		t.Fatalf("published %v, want the next spare %v", d.Order, want)
	}
}

func TestAFreedGPUIsWithdrawnOnlyAfterTheGrace(t *testing.T) {
	gpus := eight()
	gpus[6].Partitioned = true
	apply(gpus, Decide(gpus, policy, t0)) // 6 partitioned, 7 the spare
	gpus[6].Partitioned = false
	d := Decide(gpus, policy, t0)
	if s := d.States["gpu-6"]; !s.IsClosing() || !s.Closing.Equal(t0) {
		t.Fatalf("freed gpu-6: %+v, want published with the taint since %v", s, t0)
	}
	if !d.Next.Equal(t0.Add(policy.Grace)) {
		t.Fatalf("next decision at %v, want when the grace ends, %v", d.Next, t0.Add(policy.Grace))
	}
	if want := []string{"gpu-7", "gpu-6"}; !slices.Equal(d.Order, want) {
		t.Fatalf("published %v, want the spare before the closing GPU: %v", d.Order, want)
	}
	apply(gpus, d)
	// The countdown is the API's: a later decision keeps it.
	later := t0.Add(policy.Grace - time.Second)
	if s := Decide(gpus, policy, later).States["gpu-6"]; !s.Closing.Equal(t0) {
		t.Fatalf("a second before the grace ends: %+v, want closing since %v", s, t0)
	}
	if _, ok := Decide(gpus, policy, t0.Add(policy.Grace)).States["gpu-6"]; ok {
		t.Fatal("the grace is over, but gpu-6's partitions stay published")
	}
}

func TestAPrepareDuringTheGraceReopens(t *testing.T) {
	gpus := eight()
	gpus[6].Partitioned = true
	apply(gpus, Decide(gpus, policy, t0))
	gpus[6].Partitioned = false
	apply(gpus, Decide(gpus, policy, t0))
	gpus[6].Partitioned = true // an allocation made before the taint, prepared now
	s := Decide(gpus, policy, t0.Add(policy.Grace)).States["gpu-6"]
	if !s.Open || s.IsClosing() {
		t.Fatalf("gpu-6 holds a partition again: %+v, want published without the taint", s)
	}
}

// TestTheSpareIsTheHighestFreeGPUWhatEverWasPublished: the choice depends
// on what the node holds alone (two instances deciding from one checkpoint
// choose alike): a closing GPU that is the highest free one is reopened, one
// that is not keeps closing.
func TestTheSpareIsTheHighestFreeGPUWhatEverWasPublished(t *testing.T) {
	gpus := eight()
	gpus[6].Published = State{Open: true, Closing: t0}
	gpus[3].Published = State{Open: true, Closing: t0}
	gpus[7].WholeHeld = true
	d := Decide(gpus, policy, t0.Add(time.Minute))
	if s := d.States["gpu-6"]; !s.Open || s.IsClosing() {
		t.Fatalf("gpu-6: %+v, want it reopened as the spare", s)
	}
	if s := d.States["gpu-3"]; !s.IsClosing() || !s.Closing.Equal(t0) {
		t.Fatalf("gpu-3: %+v, want it still closing since %v", s, t0)
	}
	if want := []string{"gpu-6", "gpu-3"}; !slices.Equal(d.Order, want) {
		t.Fatalf("published %v, want %v", d.Order, want)
	}
}

func TestAnUnhealthyGPUIsNoSpare(t *testing.T) {
	gpus := eight()
	gpus[7].Unhealthy = true
	if want, d := []string{"gpu-6"}, Decide(gpus, policy, t0); !slices.Equal(d.Order, want) {
		t.Fatalf("published %v, want %v", d.Order, want)
	}
}

// TestDecideKeepsItsPromises drives random sequences of holds, releases,
// health and time and checks every decision against the rules the package
// promises, worked out here from the inputs alone.
func TestDecideKeepsItsPromises(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for seq := range 300 {
		gpus := eight()
		p := Policy{Spares: rng.IntN(3), Grace: time.Duration(1+rng.IntN(10)) * time.Minute}
		now := t0
		for step := range 60 {
			g := &gpus[rng.IntN(len(gpus))]
			switch rng.IntN(7) {
			case 0: // a partition prepared: only where one could be allocated
				if g.Published.Open && !g.WholeHeld {
					g.Partitioned, g.Pinned = true, false
				}
			case 1:
				if !g.Partitioned && !g.Pinned {
					g.WholeHeld = true
				}
			case 2:
				g.Partitioned, g.WholeHeld = false, false
			case 3:
				g.Unhealthy = !g.Unhealthy
			case 4:
				now = now.Add(time.Duration(rng.IntN(300)) * time.Second)
			case 5: // a partition's prepare begins (it may have raced a withdrawal)
				if !g.WholeHeld {
					g.Pinned = true
				}
			case 6: // and fails
				g.Pinned = false
			}
			d := Decide(gpus, p, now)
			where := fmt.Sprintf("sequence %d step %d", seq, step)
			check(t, where, gpus, p, now, d)
			apply(gpus, d)
		}
	}
}

func check(t *testing.T, where string, gpus []GPU, p Policy, now time.Time, d Decision) {
	t.Helper()
	// The spares: the free healthy GPUs from the highest index down,
	// whether a prepare is in flight on them or not.
	spare := map[string]bool{}
	for i := len(gpus) - 1; i >= 0 && len(spare) < p.Spares; i-- {
		if g := gpus[i]; !g.Partitioned && !g.WholeHeld && !g.Unhealthy {
			spare[g.Name] = true
		}
	}
	for _, g := range gpus {
		s, published := d.States[g.Name]
		switch {
		case g.Partitioned || g.Pinned:
			if !published || s.IsClosing() {
				t.Fatalf("%s: %s holds a partition (or one is being prepared) but is published as %+v (%v)", where, g.Name, s, published)
			}
		case g.WholeHeld:
			if published && !g.Published.Open {
				t.Fatalf("%s: %s is held whole, but its partitions are newly published", where, g.Name)
			}
		default:
			if g.Published.Open && !published {
				// Withdrawn while free: only after a full grace under the taint.
				if !g.Published.IsClosing() || now.Before(g.Published.Closing.Add(p.Grace)) {
					t.Fatalf("%s: %s was withdrawn free without a full grace under the taint (it was %+v at %v)", where, g.Name, g.Published, now)
				}
			}
			if published && s.IsClosing() && g.Published.IsClosing() && !s.Closing.Equal(g.Published.Closing) {
				t.Fatalf("%s: %s's countdown restarted: %v, then %v", where, g.Name, g.Published.Closing, s.Closing)
			}
		}
		if open := published && !s.IsClosing(); open != (g.Partitioned || g.Pinned || spare[g.Name]) {
			t.Fatalf("%s: %s published open %v, but partitioned %v, being prepared %v, a spare %v (spares %v)", where, g.Name, open, g.Partitioned, g.Pinned, spare[g.Name], spare)
		}
	}
	rank := func(name string) int {
		for _, g := range gpus {
			if g.Name == name {
				switch s := d.States[name]; {
				case g.Partitioned || g.Pinned && !spare[name]:
					return 0
				case !s.IsClosing():
					return 1
				}
			}
		}
		return 2
	}
	if !slices.IsSortedFunc(d.Order, func(a, b string) int { return rank(a) - rank(b) }) || len(d.Order) != len(d.States) {
		t.Fatalf("%s: order %v, states %v: want every published GPU once, partitioned or being prepared, then spares, then closing", where, d.Order, d.States)
	}
}
