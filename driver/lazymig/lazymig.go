// Package lazymig decides which GPUs' MIG partitions a dynamic-MIG node
// publishes when it publishes them lazily: every whole GPU always, and the
// partitions only of the GPUs that hold a partition and of a few free ones
// (the spares), so that the scheduler meets 33 devices on an empty DGX H100
// instead of 208. It is a pure function of what the node holds (the
// checkpoint), what the API shows (the node's slices) and the time; the
// kubelet plugin feeds it and publishes its answer.
//
// The one dangerous step is withdrawing partitions. The scheduler counts a
// partition's use of its GPU's counters only while the partition is
// published: withdraw one that a claim was just allocated (and the plugin
// has not prepared yet) and the scheduler may hand out the whole GPU over
// it. Decide withdraws in two cases only:
//
//   - The GPU's whole device is held: no partition of it can be allocated
//     while the whole is, so none is in flight.
//   - The GPU is free and its partitions have been published with a
//     NoSchedule taint (Closing) for the grace period, and no partition of
//     it was prepared since: the scheduler stopped allocating them when it
//     saw the taint, and the grace outlasts the binding of what it had
//     allocated before. The kubelet plugin checks, before it withdraws,
//     that the API has shown the taint that long and that no claim in the
//     API is allocated one of the partitions (a pod waiting for a volume
//     is prepared late, a claim tolerating the taint allocated late).
//
// A GPU that holds a partition, or one being prepared, is always published
// without the taint; a prepare of a partition that is not published (it
// raced a withdrawal) republishes its GPU's partitions at once.
package lazymig

import (
	"slices"
	"time"
)

// TaintKey marks the partitions of a GPU being withdrawn (effect
// NoSchedule): the scheduler stops allocating them and the plugin withdraws
// them after the grace period.
const TaintKey = "gpu.tessera.dev/partitions-withdrawn"

// GPU is what Decide knows of one GPU that offers both its whole device and
// its partitions (a MIG-switchable GPU under dynamic MIG).
type GPU struct {
	// Name is the GPU's device name (gpu-<index>); GPUs are given in index
	// order.
	Name string
	// Partitioned: a prepared claim (or one being prepared) holds one of
	// its partitions.
	Partitioned bool
	// Pinned: a prepare in flight asks for one of its partitions. Its
	// partitions stay published without the taint, as a partitioned GPU's
	// do, but it still counts as free when the spares are picked: a
	// prepare on the spare opens no other GPU until it holds its
	// partition (Partitioned), so a prepare that fails, and each retry of
	// it, changes nothing.
	Pinned bool
	// WholeHeld: a prepared claim (or one being prepared) holds the whole
	// GPU exclusively.
	WholeHeld bool
	// Unhealthy GPUs are never chosen as spares.
	Unhealthy bool
	// Published is what the API shows of its partitions now.
	Published State
}

// State is how a GPU's partitions are published.
type State struct {
	// Open: the partitions are published. Closing, with Open, says they
	// carry the withdrawal taint since then.
	Open    bool
	Closing time.Time
}

// IsClosing says whether the partitions are published with the withdrawal
// taint.
func (s State) IsClosing() bool { return s.Open && !s.Closing.IsZero() }

// Policy is the operator's choice.
type Policy struct {
	// Spares is how many free GPUs' partitions are published besides the
	// partitioned GPUs'. A claim whose partitions must span more free GPUs
	// than this cannot be allocated on a node without partitions yet.
	Spares int
	// Grace is how long a free GPU's partitions stay published with the
	// withdrawal taint before they are withdrawn. It must outlast the
	// longest wait between the scheduler's choice of a partition and its
	// write of the allocation (a Permit wait: GangScheduling's is 5
	// minutes); once written, the plugin's claim check sees it.
	Grace time.Duration
}

// DefaultPolicy is the kubelet plugin's default: one spare, as every
// single-partition claim needs, and a grace past both the GangScheduling
// plugin's Permit timeout (5 minutes), the longest kube-scheduler v1.37
// waits before writing an allocation, and its volume binding timeout (600
// s), which bounded that write in releases that ran the PreBind steps one
// after another (v1.37 runs DynamicResources' beside VolumeBinding's).
var DefaultPolicy = Policy{Spares: 1, Grace: 15 * time.Minute}

// Decision is what to publish, and when to decide again.
type Decision struct {
	// States by GPU name: the GPUs whose partitions to publish (a GPU
	// absent is published whole only).
	States map[string]State
	// Order is the published GPUs in the order the scheduler should meet
	// their partitions: partitioned GPUs first (a partition lands next to
	// others before it opens a free GPU), then the spares, then the GPUs
	// being closed.
	Order []string
	// Next is when a closing GPU's grace ends; zero when none does.
	Next time.Time
}

// Decide says which GPUs' partitions to publish at now. gpus are in index
// order.
func Decide(gpus []GPU, p Policy, now time.Time) Decision {
	d := Decision{States: map[string]State{}}
	picked := spares(gpus, p.Spares)
	spare := make([]bool, len(gpus))
	for _, i := range picked {
		spare[i] = true
	}
	var partitioned, open, closing []string
	for _, i := range picked {
		open = append(open, gpus[i].Name)
	}
	for i, g := range gpus {
		switch {
		case g.WholeHeld && !g.Partitioned && !g.Pinned:
			// Safe to withdraw at once (package doc).
		case g.Partitioned, g.Pinned && !spare[i]:
			// A pinned GPU that is no spare (a partition allocated
			// before the taint, prepared now) is about to hold one:
			// ordered as held already, so that its prepare completing
			// does not reorder what is published.
			d.States[g.Name] = State{Open: true}
			partitioned = append(partitioned, g.Name)
		case spare[i]:
			d.States[g.Name] = State{Open: true}
		case g.Published.IsClosing():
			until := g.Published.Closing.Add(p.Grace)
			if !now.Before(until) {
				break // the grace is over: withdraw
			}
			d.States[g.Name] = g.Published
			closing = append(closing, g.Name)
			if d.Next.IsZero() || until.Before(d.Next) {
				d.Next = until
			}
		case g.Published.Open:
			// The API keeps the taint's time in seconds.
			since := now.Round(time.Second).UTC()
			d.States[g.Name] = State{Open: true, Closing: since}
			closing = append(closing, g.Name)
			if until := since.Add(p.Grace); d.Next.IsZero() || until.Before(d.Next) {
				d.Next = until
			}
		}
	}
	d.Order = slices.Concat(partitioned, open, closing)
	return d
}

// spares picks the free healthy GPUs whose partitions are published, from
// the highest index down: the scheduler hands out whole GPUs first-fit from
// the lowest, so a whole-GPU claim reaches a spare last. The choice depends
// on what the node holds alone, not on what was published before, so that
// two plugin instances in a rolling update, deciding from the one
// checkpoint, choose alike. It returns their indexes in the order picked,
// which is the order they are published in.
func spares(gpus []GPU, n int) []int {
	var out []int
	for i := len(gpus) - 1; i >= 0 && len(out) < n; i-- {
		if g := gpus[i]; !g.Partitioned && !g.WholeHeld && !g.Unhealthy {
			out = append(out, i)
		}
	}
	return out
}
