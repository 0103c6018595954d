package e2e

import (
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	dynamicfake "k8s.io/client-go/dynamic/fake"
)

// splitLook is a look at an instant after the start, with that many of
// the gang's two members running.
type splitLook struct {
	at      time.Duration
	running int
}

// TestARaceWatchJudgesASplitOnItsWholeLength: members that run while others
// do not fail the watch once the split outlasts the start skew, whether a
// look falls past the skew while it lasts or the split ends first (its
// length judged at the next look), and also when it is still open at the
// report; a split shorter than the skew passes. No cluster: the watch's
// copies are set by hand and looks are made at chosen instants.
func TestARaceWatchJudgesASplitOnItsWholeLength(t *testing.T) {
	const skew = 30 * time.Second
	t0 := time.Unix(1_000_000, 0)
	for _, tc := range []struct {
		name string
		// looks: instants (after t0) and how many of the two members run.
		looks []splitLook
		// openAtReport: the split is still open, longer than the skew,
		// when the report is taken (the report reads the clock).
		openAtReport bool
		fails        bool
	}{
		{name: "short split", looks: []splitLook{{0, 1}, {10 * time.Second, 2}}, fails: false},
		{name: "long split ended by the next look", looks: []splitLook{{0, 1}, {60 * time.Second, 2}}, fails: true},
		{name: "long split seen while it lasts", looks: []splitLook{{0, 1}, {31 * time.Second, 1}, {32 * time.Second, 2}}, fails: true},
		{name: "long split open at the report", looks: []splitLook{{0, 1}}, openAtReport: true, fails: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newRaceWatch(nil, dynamicfake.NewSimpleDynamicClient(runtime.NewScheme()), "train", 2, 2, skew)
			w.ledger = newLedger(nil)
			for i := range 2 {
				uid := types.UID(fmt.Sprintf("m-%d", i))
				w.pods[uid] = &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("train-%d", i), UID: uid, Labels: map[string]string{jobName: "train"}}}
			}
			for _, l := range tc.looks {
				for i := range 2 {
					phase := corev1.PodPending
					if i < l.running {
						phase = corev1.PodRunning
					}
					w.pods[types.UID(fmt.Sprintf("m-%d", i))].Status.Phase = phase
				}
				w.look(t0.Add(l.at))
			}
			if tc.openAtReport {
				w.splitSince = time.Now().Add(-2 * skew)
			}
			r := w.report()
			failed := false
			for _, f := range r.failures {
				failed = failed || strings.Contains(f, "start skew")
			}
			if failed != tc.fails {
				t.Errorf("split failures %v, want a failure: %v", r.failures, tc.fails)
			}
		})
	}
}
