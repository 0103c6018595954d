package v1alpha1

import (
	"fmt"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
)

// Members picks a gang's pods, by label selector or by PodGroup.
type Members struct {
	selector labels.Selector
	podGroup string
}

// Matches says whether the pod (of the gang's namespace) is a member.
func (m Members) Matches(p *corev1.Pod) bool {
	if m.podGroup != "" {
		return p.Spec.SchedulingGroup != nil && p.Spec.SchedulingGroup.PodGroupName != nil && *p.Spec.SchedulingGroup.PodGroupName == m.podGroup
	}
	return m.selector != nil && m.selector.Matches(labels.Set(p.Labels))
}

// Validate checks a gang's spec beyond what the CRD schema checks, and
// returns how it picks its members. Errors name the field and the fix.
func Validate(g *Gang) (Members, error) {
	if g.Spec.Size < 1 {
		return Members{}, fmt.Errorf("gang %s/%s: spec.size %d: want at least 1", g.Namespace, g.Name, g.Spec.Size)
	}
	if g.Spec.DomainClaimName != "" && g.Spec.Size > MaxSizeWithDomainClaim {
		return Members{}, fmt.Errorf("gang %s/%s: spec.size %d with spec.domainClaimName: a claim is reserved for at most %d pods; leave domainClaimName empty for a larger gang (it is still placed in one domain, without a channel)", g.Namespace, g.Name, g.Spec.Size, MaxSizeWithDomainClaim)
	}
	sel, err := metav1.LabelSelectorAsSelector(&g.Spec.Selector)
	if err != nil {
		return Members{}, fmt.Errorf("gang %s/%s: spec.selector: %w", g.Namespace, g.Name, err)
	}
	switch {
	case g.Spec.PodGroupName != "" && !sel.Empty():
		return Members{}, fmt.Errorf("gang %s/%s: spec.selector and spec.podGroupName are both set; keep one (podGroupName: the pods of that PodGroup)", g.Namespace, g.Name)
	case g.Spec.PodGroupName != "":
		return Members{podGroup: g.Spec.PodGroupName}, nil
	case sel.Empty():
		return Members{}, fmt.Errorf("gang %s/%s: spec.selector is empty and would select every pod of the namespace; select the members by a label (e.g. job-name), or name a PodGroup (spec.podGroupName)", g.Namespace, g.Name)
	}
	return Members{selector: sel}, nil
}
