package gang

import (
	"fmt"
	"strings"

	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
)

// setCondition sets one condition on the status, keeping its transition time
// when the status does not change.
func setCondition(st *gangv1.GangStatus, gen int64, typ string, status bool, reason, message string) {
	s := metav1.ConditionFalse
	if status {
		s = metav1.ConditionTrue
	}
	meta.SetStatusCondition(&st.Conditions, metav1.Condition{Type: typ, Status: s, Reason: reason, Message: message, ObservedGeneration: gen})
}

// waiting sets the conditions of a gang whose members are held.
func waiting(st *gangv1.GangStatus, gen int64, reason, message string) {
	setCondition(st, gen, gangv1.ConditionWaiting, true, reason, message)
	setCondition(st, gen, gangv1.ConditionPlaced, false, reason, "not placed: "+message)
	setCondition(st, gen, gangv1.ConditionRunning, false, reason, "not placed")
	if c := meta.FindStatusCondition(st.Conditions, gangv1.ConditionFailed); c == nil {
		setCondition(st, gen, gangv1.ConditionFailed, false, gangv1.ReasonNone, "no member lost")
	}
	st.Domain, st.Nodes = "", nil
}

// statusChanged says whether a status write is needed.
func statusChanged(old, cur *gangv1.GangStatus) bool {
	return !equality.Semantic.DeepEqual(old, cur)
}

// conditionMessage is a condition's current message ("" when absent).
func conditionMessage(st *gangv1.GangStatus, typ string) string {
	if c := meta.FindStatusCondition(st.Conditions, typ); c != nil {
		return c.Message
	}
	return ""
}

// noFitMessage says why no domain fits: the closest ones and what each
// lacked.
func noFitMessage(size int, vs []verdict) string {
	return noFitMessageFor(size, fmt.Sprintf("all %d members", size), vs)
}

// noFitMessageFor is noFitMessage saying what had to fit in words (the
// minimum of an elastic gang).
func noFitMessageFor(size int, what string, vs []verdict) string {
	if len(vs) == 0 {
		return fmt.Sprintf("no domain is published for %d members: no node's slices show an NVLink clique and no node carries the controller's topology label", size)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "no domain fits %s; closest: ", what)
	for i, v := range vs {
		if i == 3 {
			fmt.Fprintf(&b, "; and %d more", len(vs)-3)
			break
		}
		if i > 0 {
			b.WriteString("; ")
		}
		fmt.Fprintf(&b, "%s: %s", v.pool, v.lacks)
	}
	return b.String()
}
