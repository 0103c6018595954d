package v1alpha1

import (
	"fmt"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
)

// Validate checks a gang's spec beyond what the CRD schema checks, and
// returns its member selector. Errors name the field and the fix.
func Validate(g *Gang) (labels.Selector, error) {
	if g.Spec.Size < 1 {
		return nil, fmt.Errorf("gang %s/%s: spec.size %d: want at least 1", g.Namespace, g.Name, g.Spec.Size)
	}
	if g.Spec.DomainClaimName != "" && g.Spec.Size > MaxSizeWithDomainClaim {
		return nil, fmt.Errorf("gang %s/%s: spec.size %d with spec.domainClaimName: a claim is reserved for at most %d pods; leave domainClaimName empty for a larger gang (it is still placed in one domain, without a channel)", g.Namespace, g.Name, g.Spec.Size, MaxSizeWithDomainClaim)
	}
	sel, err := metav1.LabelSelectorAsSelector(&g.Spec.Selector)
	if err != nil {
		return nil, fmt.Errorf("gang %s/%s: spec.selector: %w", g.Namespace, g.Name, err)
	}
	if sel.Empty() {
		return nil, fmt.Errorf("gang %s/%s: spec.selector is empty and would select every pod of the namespace; select the members by a label (e.g. job-name)", g.Namespace, g.Name)
	}
	return sel, nil
}
