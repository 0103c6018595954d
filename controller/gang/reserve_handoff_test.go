package gang

import (
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	k8stesting "k8s.io/client-go/testing"
)

// callLog records, in order, the deletions of DeviceTaintRules that exist
// (tries included) and the
// releases of pods (an update that leaves a gated pod without its gate)
// the fake API server receives.
type callLog struct {
	mu    sync.Mutex
	calls []string
	gated map[string]bool
}

// record installs the reactors that fill the log; failDeletes is how many
// rule deletions, from the first, the API server refuses.
func (l *callLog) record(f *fakeCluster, failDeletes int) {
	l.gated = map[string]bool{}
	f.client.PrependReactor("delete", "devicetaintrules", func(a k8stesting.Action) (bool, runtime.Object, error) {
		l.mu.Lock()
		defer l.mu.Unlock()
		name := a.(k8stesting.DeleteAction).GetName()
		if failDeletes > 0 {
			failDeletes--
			l.calls = append(l.calls, "failed delete "+name)
			return true, nil, errors.New("the API server is away")
		}
		if _, err := f.client.Tracker().Get(resourceapi.SchemeGroupVersion.WithResource("devicetaintrules"), "", name); err == nil {
			l.calls = append(l.calls, "delete "+name) // not a delete of a rule gone already
		}
		return false, nil, nil
	})
	f.client.PrependReactor("update", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		l.mu.Lock()
		defer l.mu.Unlock()
		p := a.(k8stesting.UpdateAction).GetObject().(*v1.Pod)
		old, err := f.client.Tracker().Get(v1.SchemeGroupVersion.WithResource("pods"), p.Namespace, p.Name)
		if err == nil && hasGate(old.(*v1.Pod)) && !hasGate(p) {
			l.calls = append(l.calls, "release "+p.Name)
		}
		return false, nil, nil
	})
}

// releasedBeforeDelete names the first release logged before the last
// deletion of a rule, "" when every rule went first.
func (l *callLog) releasedBeforeDelete() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	last := -1
	for i, c := range l.calls {
		if strings.HasPrefix(c, "delete ") {
			last = i
		}
	}
	for i, c := range l.calls[:max(last, 0)] {
		if strings.HasPrefix(c, "release ") {
			return l.calls[i]
		}
	}
	return ""
}

// The reservation's DeviceTaintRule is deleted before any member of its
// gang is released (for members that do not tolerate its started key):
// released members must not meet their own reservation's taint, which the
// scheduler would hold against them. Also when the first deletion fails:
// no member is released until a look has deleted the rule.
func TestAReservationsRuleGoesBeforeItsMembersAreReleased(t *testing.T) {
	for _, tc := range []struct {
		name        string
		failDeletes int
	}{
		{"the rule deleted at the first try", 0},
		{"the first deletion of the rule fails", 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := reservationCluster(t, -30*time.Second)
			f.prioGang("big", 4, 1, 0, nil)
			if g := f.reconcileOK("big"); g.Status.Reservation == nil || len(f.taintRules()) != 1 {
				t.Fatalf("not reserved: %+v, rules %+v", g.Status.Reservation, f.taintRules())
			}
			if err := f.client.CoreV1().Pods("ml").Delete(f.ctx, "short-b1", metav1.DeleteOptions{}); err != nil {
				t.Fatal(err)
			}
			f.freeClaimsOfGonePods()
			var log callLog
			log.record(f, tc.failDeletes)
			for look := 0; look < 3 && (len(f.taintRules()) > 0 || hasGate(f.pod("ml", "big-0"))); look++ {
				_, _ = f.reconcile("ml", "big") // a failed deletion fails its look
			}
			if rules := f.taintRules(); len(rules) != 0 || hasGate(f.pod("ml", "big-0")) {
				t.Fatalf("after the looks: rules %+v, big-0 gated %v; want the rule gone and the members released", rules, hasGate(f.pod("ml", "big-0")))
			}
			if r := log.releasedBeforeDelete(); r != "" {
				t.Errorf("%s before the reservation's rule was deleted; calls: %v", r, log.calls)
			}
			t.Logf("calls: %v", log.calls)
		})
	}
}
