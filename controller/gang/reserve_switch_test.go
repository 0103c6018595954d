package gang

import (
	"slices"
	"testing"
	"time"

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
