package examples_test

import (
	"fmt"
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	schedulingv1alpha3 "k8s.io/api/scheduling/v1alpha3"
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
				// A CompositePodGroup's children are its gang's roles:
				// TestCompositePodGroupExampleIsPlacedAsOneGangOfRoles.
				if o.Spec.ParentCompositePodGroupName == nil {
					groups = append(groups, o)
				}
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

// TestCompositePodGroupExampleIsPlacedAsOneGangOfRoles checks what the
// CompositePodGroup example needs to start as one gang: each child PodGroup
// has a Job whose gated pods join it, as many as its minCount, and name the
// domain claim every child names; and tessera-controller derives from the
// file's objects one gang whose roles are the children in the Workload's
// order, sharing that claim.
func TestCompositePodGroupExampleIsPlacedAsOneGangOfRoles(t *testing.T) {
	const file = "podgroup/disaggregated-inference.yaml"
	jobs := map[string]*batchv1.Job{}
	claims := map[string]*resourceapi.ResourceClaim{}
	var composites []*schedulingv1alpha3.CompositePodGroup
	var children []*schedulingv1beta1.PodGroup
	var workloads []*schedulingv1beta1.Workload
	for _, o := range objects(t)[file] {
		switch o := o.(type) {
		case *batchv1.Job:
			if sg := o.Spec.Template.Spec.SchedulingGroup; sg != nil && sg.PodGroupName != nil {
				jobs[*sg.PodGroupName] = o
			}
		case *resourceapi.ResourceClaim:
			claims[o.Name] = o
		case *schedulingv1alpha3.CompositePodGroup:
			composites = append(composites, o)
		case *schedulingv1beta1.PodGroup:
			children = append(children, o)
		case *schedulingv1beta1.Workload:
			workloads = append(workloads, o)
		}
	}
	if len(composites) != 1 || len(children) != 2 || len(workloads) != 1 {
		t.Fatalf("%s: %d CompositePodGroups, %d PodGroups, %d Workloads; want 1, 2 and 1", file, len(composites), len(children), len(workloads))
	}
	for _, pg := range children {
		job := jobs[pg.Name]
		if job == nil || pg.Spec.SchedulingPolicy.Gang == nil || ptr.Deref(pg.Spec.ParentCompositePodGroupName, "") != composites[0].Name {
			t.Errorf("%s: PodGroup %s needs a gang policy, the CompositePodGroup as its parent and a Job whose pods join it", file, pg.Name)
			continue
		}
		checkMemberJob(t, file, job, pg.Spec.SchedulingPolicy.Gang.MinCount, "its PodGroup's minCount")
		if !slices.ContainsFunc(job.Spec.Template.Spec.ResourceClaims, func(p corev1.PodResourceClaim) bool {
			return ptr.Deref(p.ResourceClaimName, "") == "infer-domain"
		}) {
			t.Errorf("%s: Job %s's pods do not share the domain claim infer-domain", file, job.Name)
		}
	}
	g, why := podgroups.DesiredComposite(composites[0], children, nil, podgroups.Lookups{
		Claim: func(_, name string) (*resourceapi.ResourceClaim, error) {
			if c := claims[name]; c != nil {
				return c, nil
			}
			return nil, fmt.Errorf("no claim %s", name)
		},
		Workload: func(_, name string) (*schedulingv1beta1.Workload, error) {
			if workloads[0].Name == name {
				return workloads[0], nil
			}
			return nil, fmt.Errorf("no workload %s", name)
		},
	})
	if g == nil {
		t.Fatalf("%s: the CompositePodGroup is not placed as a gang: %q", file, why)
	}
	want := gangv1.GangSpec{Size: 3, CompositePodGroupName: "infer", DomainClaimName: "infer-domain", Roles: []gangv1.Role{
		{Name: "infer-prefill", Size: 1, PodGroupName: "infer-prefill"},
		{Name: "infer-decode", Size: 2, PodGroupName: "infer-decode"},
	}}
	if diff := cmp.Diff(want, g.Spec); diff != "" {
		t.Errorf("%s: gang of the CompositePodGroup (-want +got):\n%s", file, diff)
	}
	if _, err := gangv1.Validate(g); err != nil {
		t.Errorf("%s: %v", file, err)
	}
}
