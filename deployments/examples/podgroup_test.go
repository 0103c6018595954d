package examples_test

import (
	"fmt"
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	schedulingv1beta1 "k8s.io/api/scheduling/v1beta1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/controller/podgroups"
)

// TestPodGroupExampleIsPlacedAsAGang checks what the PodGroup example needs
// to start as a gang: its Job's pods join the PodGroup, are gated, as many as
// its minCount, and carry the PodGroup's claim entries verbatim (so that they
// share the group's claim); and, once the resourceclaim controller has made
// the group claim from its template, tessera-controller derives the Gang the
// example describes from it.
func TestPodGroupExampleIsPlacedAsAGang(t *testing.T) {
	found := 0
	for file, objs := range objects(t) {
		jobs := map[string]*batchv1.Job{}
		templates := map[string]*resourceapi.ResourceClaimTemplate{}
		var groups []*schedulingv1beta1.PodGroup
		for _, o := range objs {
			switch o := o.(type) {
			case *batchv1.Job:
				if sg := o.Spec.Template.Spec.SchedulingGroup; sg != nil && sg.PodGroupName != nil {
					jobs[*sg.PodGroupName] = o
				}
			case *resourceapi.ResourceClaimTemplate:
				templates[o.Name] = o
			case *schedulingv1beta1.PodGroup:
				groups = append(groups, o)
			}
		}
		for _, pg := range groups {
			found++
			job := jobs[pg.Name]
			if job == nil || pg.Spec.SchedulingPolicy.Gang == nil {
				t.Errorf("%s: PodGroup %s needs a gang policy and a Job whose pods join it (spec.schedulingGroup.podGroupName)", file, pg.Name)
				continue
			}
			n := pg.Spec.SchedulingPolicy.Gang.MinCount
			checkMemberJob(t, file, job, n, "the PodGroup's minCount")
			pod := job.Spec.Template.Spec
			// The resourceclaim controller makes each template claim once
			// for the group and records it in the PodGroup's status.
			pg := pg.DeepCopy()
			pg.UID = "pg-uid"
			claims := map[string]*resourceapi.ResourceClaim{}
			for _, rc := range pg.Spec.ResourceClaims {
				if !slices.ContainsFunc(pod.ResourceClaims, func(p corev1.PodResourceClaim) bool {
					return p.Name == rc.Name && ptr.Equal(p.ResourceClaimName, rc.ResourceClaimName) && ptr.Equal(p.ResourceClaimTemplateName, rc.ResourceClaimTemplateName)
				}) {
					t.Errorf("%s: Job %s's pods lack the PodGroup's claim entry %s verbatim: they would each get a claim of their own", file, job.Name, rc.Name)
				}
				tmpl := templates[ptr.Deref(rc.ResourceClaimTemplateName, "")]
				if tmpl == nil {
					t.Errorf("%s: PodGroup %s claim %s: no template in the file", file, pg.Name, rc.Name)
					continue
				}
				name := fmt.Sprintf("%s-%s-x7k2p", pg.Name, rc.Name)
				claims[name] = &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: pg.Namespace}, Spec: tmpl.Spec.Spec}
				pg.Status.ResourceClaimStatuses = append(pg.Status.ResourceClaimStatuses, schedulingv1beta1.PodGroupResourceClaimStatus{Name: rc.Name, ResourceClaimName: ptr.To(name)})
			}
			g, why := podgroups.Desired(pg, func(_, name string) (*resourceapi.ResourceClaim, error) {
				if c := claims[name]; c != nil {
					return c, nil
				}
				return nil, fmt.Errorf("no claim %s", name)
			})
			if g == nil {
				t.Errorf("%s: PodGroup %s is not placed as a gang: %q", file, pg.Name, why)
				continue
			}
			want := gangv1.GangSpec{Size: n, PodGroupName: pg.Name, DomainClaimName: pg.Name + "-domain-x7k2p"}
			if diff := cmp.Diff(want, g.Spec); diff != "" {
				t.Errorf("%s: gang of PodGroup %s (-want +got):\n%s", file, pg.Name, diff)
			}
			if _, err := gangv1.Validate(g); err != nil {
				t.Errorf("%s: %v", file, err)
			}
		}
	}
	if found != 1 {
		t.Errorf("found %d PodGroup examples, want 1", found)
	}
}
