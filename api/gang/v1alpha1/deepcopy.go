package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
)

// Hand-written deep copies (no code generators offline); keep them in step
// with types.go.

// DeepCopyInto copies g into out.
func (g *Gang) DeepCopyInto(out *Gang) {
	*out = *g
	out.TypeMeta = g.TypeMeta
	g.ObjectMeta.DeepCopyInto(&out.ObjectMeta)
	g.Spec.DeepCopyInto(&out.Spec)
	g.Status.DeepCopyInto(&out.Status)
}

// DeepCopy returns a copy of g.
func (g *Gang) DeepCopy() *Gang {
	if g == nil {
		return nil
	}
	out := new(Gang)
	g.DeepCopyInto(out)
	return out
}

// DeepCopyObject implements runtime.Object.
func (g *Gang) DeepCopyObject() runtime.Object { return g.DeepCopy() }

// DeepCopyInto copies s into out.
func (s *GangSpec) DeepCopyInto(out *GangSpec) {
	*out = *s
	s.Selector.DeepCopyInto(&out.Selector)
	if s.Placement != nil {
		p := *s.Placement
		out.Placement = &p
	}
	if s.Roles != nil {
		out.Roles = make([]Role, len(s.Roles))
		for i := range s.Roles {
			out.Roles[i] = s.Roles[i]
			s.Roles[i].Selector.DeepCopyInto(&out.Roles[i].Selector)
		}
	}
}

// DeepCopyInto copies s into out.
func (s *GangStatus) DeepCopyInto(out *GangStatus) {
	*out = *s
	if s.Nodes != nil {
		out.Nodes = append([]string(nil), s.Nodes...)
	}
	if s.Conditions != nil {
		out.Conditions = make([]metav1.Condition, len(s.Conditions))
		for i := range s.Conditions {
			s.Conditions[i].DeepCopyInto(&out.Conditions[i])
		}
	}
	if s.Preemption != nil {
		p := *s.Preemption
		p.Victims = append([]string(nil), s.Preemption.Victims...)
		out.Preemption = &p
	}
	out.Reservation = s.Reservation.DeepCopy()
	if s.BackfillRefusals != nil {
		out.BackfillRefusals = make([]BackfillRefusal, len(s.BackfillRefusals))
		for i := range s.BackfillRefusals {
			out.BackfillRefusals[i] = s.BackfillRefusals[i]
			s.BackfillRefusals[i].Since.DeepCopyInto(&out.BackfillRefusals[i].Since)
		}
	}
}

// DeepCopy copies the reservation (nil for nil).
func (r *Reservation) DeepCopy() *Reservation {
	if r == nil {
		return nil
	}
	out := *r
	r.Start.DeepCopyInto(&out.Start)
	r.Since.DeepCopyInto(&out.Since)
	out.Nodes = append([]string(nil), r.Nodes...)
	out.WaitingFor = append([]string(nil), r.WaitingFor...)
	if r.Yields != nil {
		out.Yields = make([]ReservationYield, len(r.Yields))
		for i := range r.Yields {
			out.Yields[i] = r.Yields[i]
			r.Yields[i].At.DeepCopyInto(&out.Yields[i].At)
		}
	}
	return &out
}

// DeepCopyInto copies l into out.
func (l *GangList) DeepCopyInto(out *GangList) {
	*out = *l
	out.TypeMeta = l.TypeMeta
	l.ListMeta.DeepCopyInto(&out.ListMeta)
	if l.Items != nil {
		out.Items = make([]Gang, len(l.Items))
		for i := range l.Items {
			l.Items[i].DeepCopyInto(&out.Items[i])
		}
	}
}

// DeepCopy returns a copy of l.
func (l *GangList) DeepCopy() *GangList {
	if l == nil {
		return nil
	}
	out := new(GangList)
	l.DeepCopyInto(out)
	return out
}

// DeepCopyObject implements runtime.Object.
func (l *GangList) DeepCopyObject() runtime.Object { return l.DeepCopy() }

// DeepCopy returns a copy of s.
func (s *GangStatus) DeepCopy() *GangStatus {
	if s == nil {
		return nil
	}
	out := new(GangStatus)
	s.DeepCopyInto(out)
	return out
}
