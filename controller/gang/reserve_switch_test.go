package gang

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	k8stesting "k8s.io/client-go/testing"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
)

// A pod tolerating every taint that came under the reservation's first rule
// is still backfill after the rule switched to the started key: its
// eviction refused once in the switch's look (a disruption budget) is
// tried again. The API server stamps a rule's creation (the fake does not:
// a reactor does here); the switch's rule is created a minute after the
// first.
func TestABlanketPodWhoseEvictionWasRefusedAtTheSwitchIsEvictedLater(t *testing.T) {
	f := reservationCluster(t, 10*time.Minute)
	stamp := time.Now()
	f.client.PrependReactor("create", "devicetaintrules", func(a k8stesting.Action) (bool, runtime.Object, error) {
		r := a.(k8stesting.CreateAction).GetObject().(*resourceapi.DeviceTaintRule)
		r.CreationTimestamp = metav1.NewTime(stamp)
		return false, nil, nil
	})
	refuse := 1
	f.client.PrependReactor("create", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.GetSubresource() != "eviction" || refuse == 0 {
			return false, nil, nil
		}
		if a.(k8stesting.CreateAction).GetObject().(metav1.Object).GetName() != "greedy" {
			return false, nil, nil
		}
		refuse--
		return true, nil, apierrors.NewTooManyRequests("budget", 10)
	})
	f.reserveB1()
	f.backfillEndsAndAPodTakesItsGPU("greedy", 0, everyTaint)
	f.shortB1Overran()
	// The start: the started rule is created a minute after the first.
	stamp = time.Now().Add(time.Minute)
	f.reconcileOK("big")
	t.Logf("after the switch look: evicted %v, rules %v", f.evicted, ruleKeysAndTimes(f.taintRules()))
	for look := range 3 {
		g := f.reconcileOK("big")
		t.Logf("look %d: evicted %v, rules %v, reservation %+v, msg %s", look, f.evicted, ruleKeysAndTimes(f.taintRules()), g.Status.Reservation, conditionMessage(&g.Status, gangv1.ConditionWaiting))
	}
	if !slices.Contains(f.evicted, "greedy") {
		t.Errorf("greedy (blanket toleration, came under the reservation) never evicted once its first eviction was refused")
	}
}

func ruleKeysAndTimes(rs []resourceapi.DeviceTaintRule) []string {
	var out []string
	for _, r := range rs {
		out = append(out, r.Spec.Taint.Key+"@"+r.CreationTimestamp.Format(time.TimeOnly))
	}
	return out
}

// A pod tolerating every taint that came under the reservation's first rule
// is evicted once the pod the reservation waits for has ended, although the
// switch's look evicted no one (that pod declared its end by annotation
// only) and the rule was replaced by the started key's meanwhile.
func TestABlanketPodIsEvictedWhenTheSwitchWaitedForADeclaredEnd(t *testing.T) {
	snap, nodes := trays(t, map[string]uint32{"a1": 1, "b1": 2, "b2": 2})
	f := newFakeCluster(t, snap, nodes)
	f.runningPod("long-a1", "a1", 4, 0, startedAgo(time.Minute), expectedRuntime("2h"))
	f.runningPod("short-b1", "b1", 3, 0, startedAgo(20*time.Minute), expectedRuntime("30m"))
	f.runningPod("bf-b1", "b1", 1, 0, startedAgo(time.Minute), backfillPod)
	f.runningPod("forever-b2", "b2", 4, 0, startedAgo(time.Minute))
	stamp := time.Now()
	f.client.PrependReactor("create", "devicetaintrules", func(a k8stesting.Action) (bool, runtime.Object, error) {
		r := a.(k8stesting.CreateAction).GetObject().(*resourceapi.DeviceTaintRule)
		r.CreationTimestamp = metav1.NewTime(stamp)
		return false, nil, nil
	})
	f.reserveB1()
	f.backfillEndsAndAPodTakesItsGPU("greedy", 0, everyTaint)
	f.shortB1Overran()
	stamp = time.Now().Add(time.Minute)
	g := f.reconcileOK("big")
	t.Logf("switch look: evicted %v, rules %v, reservation %+v", f.evicted, ruleKeysAndTimes(f.taintRules()), g.Status.Reservation)
	if err := f.client.CoreV1().Pods("ml").Delete(f.ctx, "short-b1", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	f.freeClaimsOfGonePods()
	for look := range 2 {
		g := f.reconcileOK("big")
		t.Logf("look %d: evicted %v, rules %v, reservation %+v", look, f.evicted, ruleKeysAndTimes(f.taintRules()), g.Status.Reservation)
	}
	if !slices.Contains(f.evicted, "greedy") {
		t.Errorf("greedy (blanket toleration, came under the reservation) never evicted after the pod waited for ended")
	}
}

// refuseEvictions makes the API server refuse the next n evictions of pod
// ml/<name> as a PodDisruptionBudget does (429 TooManyRequests).
func (f *fakeCluster) refuseEvictions(name string, n int) {
	f.client.PrependReactor("create", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.GetSubresource() != "eviction" || n == 0 || a.(k8stesting.CreateAction).GetObject().(metav1.Object).GetName() != name {
			return false, nil, nil
		}
		n--
		return true, nil, apierrors.NewTooManyRequests("Cannot evict pod as it would violate the pod's disruption budget.", 10)
	})
}

// A backfill pod whose eviction at the start a PodDisruptionBudget refuses
// still holds its devices: the reservation waits for it (its status lists
// it), says why on the gang and on the pod (a warning, no BackfillEvicted),
// counts the refusal, and tries again on a look seconds later, until the
// budget lets it go.
func TestARefusedBackfillEvictionKeepsThePodHoldingItsDevices(t *testing.T) {
	f := reservationCluster(t, -30*time.Second)
	reg := prometheus.NewRegistry()
	m, err := NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	f.r.metrics = m
	f.refuseEvictions("bf-b1", 2)
	f.prioGang("big", 4, 1, 0, nil)
	for look := range 2 {
		res, err := f.reconcile("ml", "big")
		if err != nil {
			t.Fatal(err)
		}
		g := f.gang("ml", "big")
		r := g.Status.Reservation
		if r == nil || !slices.Contains(r.WaitingFor, "ml/bf-b1") || len(f.evicted) != 0 {
			t.Fatalf("look %d: reservation %+v, evicted %v; want it waiting for the backfill pod whose eviction was refused", look, r, f.evicted)
		}
		if msg := conditionMessage(&g.Status, gangv1.ConditionWaiting); !strings.Contains(msg, "refused") || !strings.Contains(msg, "ml/bf-b1") || strings.Contains(msg, "evicted 1") {
			t.Errorf("look %d: waiting: %s", look, msg)
		}
		events := strings.Join(f.drainEvents(), "\n")
		if !strings.Contains(events, "Warning "+gangv1.ReasonBackfillEvictionRefused) || strings.Contains(events, gangv1.ReasonBackfillEvicted+" ") {
			t.Errorf("look %d: events:\n%s", look, events)
		}
		if got := testutil.ToFloat64(m.backfill.WithLabelValues("refused")); got != float64(look+1) {
			t.Errorf("look %d: %v refusals counted, want %d", look, got, look+1)
		}
		if res.requeueAfter <= 0 || res.requeueAfter > 5*time.Second {
			t.Errorf("look %d: next look in %v, want a retry within seconds", look, res.requeueAfter)
		}
	}
	g := f.reconcileOK("big")
	if !slices.Equal(f.evicted, []string{"bf-b1"}) || slices.Contains(g.Status.Reservation.WaitingFor, "ml/bf-b1") {
		t.Fatalf("the budget allows it: evicted %v, waiting for %v", f.evicted, g.Status.Reservation.WaitingFor)
	}
	if got := testutil.ToFloat64(m.backfill.WithLabelValues("evicted")); got != 1 {
		t.Errorf("%v evictions counted, want 1", got)
	}
}
