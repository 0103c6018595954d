package gang

import (
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
)

func TestGangStatesAreCountedFromTheLeadersInformer(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	if n, err := testutil.GatherAndCount(reg, "tessera_gangs"); err != nil || n != 0 {
		t.Fatalf("a controller that does not lead reports %d gang states (%v), want none", n, err)
	}
	gang := func(name string, conds ...metav1.Condition) any {
		u, err := toUnstructured(&gangv1.Gang{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ml"}, Status: gangv1.GangStatus{Conditions: conds}})
		if err != nil {
			t.Fatal(err)
		}
		return u
	}
	cond := func(typ string, status metav1.ConditionStatus) metav1.Condition {
		return metav1.Condition{Type: typ, Status: status, Reason: "R"}
	}
	stop := m.watch(func() []any {
		return []any{
			gang("new"),
			gang("waits", cond(gangv1.ConditionWaiting, metav1.ConditionTrue)),
			gang("placed", cond(gangv1.ConditionWaiting, metav1.ConditionFalse), cond(gangv1.ConditionPlaced, metav1.ConditionTrue)),
			gang("runs", cond(gangv1.ConditionPlaced, metav1.ConditionTrue), cond(gangv1.ConditionRunning, metav1.ConditionTrue)),
			gang("failed", cond(gangv1.ConditionPlaced, metav1.ConditionTrue), cond(gangv1.ConditionFailed, metav1.ConditionTrue)),
		}
	})
	want := `
# HELP tessera_gangs Gangs by state (Waiting, Placed, Running, Failed: the most advanced true condition), as the leading controller sees them; absent on standbys.
# TYPE tessera_gangs gauge
tessera_gangs{state="Failed"} 1
tessera_gangs{state="Placed"} 1
tessera_gangs{state="Running"} 1
tessera_gangs{state="Waiting"} 2
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "tessera_gangs"); err != nil {
		t.Error(err)
	}
	stop()
	if n, _ := testutil.GatherAndCount(reg, "tessera_gangs"); n != 0 {
		t.Errorf("after leadership ended %d gang states are still reported", n)
	}
}
