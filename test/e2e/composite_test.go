package e2e

import (
	"context"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/controller/gang"
	"github.com/tessera-dev/tessera/driver/domain"
	"github.com/tessera-dev/tessera/test/cluster"
)

// TestCompositePodGroupRunsAsOneGangOfRoles applies
// deployments/examples/podgroup/disaggregated-inference.yaml on a cluster
// that serves Kubernetes 1.37's CompositePodGroups (alpha gates on in every
// component), with tessera-controller as its own service account: a
// prefill group of one tray-sized server and a decode group of two. Clique
// A has three GB200 trays, clique B two, so the three servers fit only in
// A. Before the decode Job exists the prefill pod stays gated with nothing
// allocated, and the CompositePodGroup's gang waits naming the decode role;
// its child PodGroups get no gangs of their own. Once the decode Job is
// created, all three run in clique A on three trays, with one IMEX channel
// of A, ranks by role in the Workload's order (prefill 0, decode 1 and 2)
// and each container's role env. Deleting the CompositePodGroup takes its
// gang.
func TestCompositePodGroupRunsAsOneGangOfRoles(t *testing.T) {
	t.Parallel()
	const (
		cliqueA = "3e9a61c2-5b7d-4f10-8c2e-6d4b1a7f9e03.1"
		cliqueB = "3e9a61c2-5b7d-4f10-8c2e-6d4b1a7f9e03.2"
		ns      = metav1.NamespaceDefault
	)
	c := startTesseraWith(t, cluster.Options{CompositePodGroups: true},
		gpuNodeSpec{name: "tray-a1", profile: "gb200-nvl72-tray", clique: cliqueA},
		gpuNodeSpec{name: "tray-a2", profile: "gb200-nvl72-tray", clique: cliqueA},
		gpuNodeSpec{name: "tray-a3", profile: "gb200-nvl72-tray", clique: cliqueA},
		gpuNodeSpec{name: "tray-b1", profile: "gb200-nvl72-tray", clique: cliqueB},
		gpuNodeSpec{name: "tray-b2", profile: "gb200-nvl72-tray", clique: cliqueB},
	)
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
	defer cancel()
	installAndStartController(ctx, t, c.Cluster, "")
	poolA, poolB := domain.PoolName(domain.KindNVLink, cliqueA), domain.PoolName(domain.KindNVLink, cliqueB)
	waitDomains(ctx, t, c, map[string]int{poolA: 3, poolB: 2})
	gs := newGangs(t, c.Cluster)

	// Everything but the decode Job, the file's last object.
	file := filepath.Join(examplesDir, podGroupExamples, "disaggregated-inference.yaml")
	data, err := os.ReadFile(file)
	noErr(t, err)
	docs := strings.Split(string(data), "\n---\n")
	last := docs[len(docs)-1]
	if !strings.Contains(last, "kind: Job\n") || !strings.Contains(last, "name: infer-decode\n") {
		t.Fatalf("%s: the last object is not the Job infer-decode:\n%s", file, last)
	}
	if err := c.Apply(ctx, []byte(strings.Join(docs[:len(docs)-1], "\n---\n"))); err != nil {
		t.Fatalf("apply %s without the decode Job: %v", file, err)
	}
	var g *gangv1.Gang
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		u, err := gs.dyn.Resource(gangv1.GroupVersionResource).Namespace(ns).Get(ctx, "infer", metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		if g, err = gang.FromUnstructured(u); err != nil {
			return false, err
		}
		w := meta.FindStatusCondition(g.Status.Conditions, gangv1.ConditionWaiting)
		return w != nil && w.Status == metav1.ConditionTrue && w.Reason == gangv1.ReasonMembersMissing && strings.Contains(w.Message, "infer-decode"), nil
	})
	if err != nil {
		t.Fatalf("the CompositePodGroup's gang does not wait for its decode role: %v; conditions:\n%s\nevents:\n%s", err, describeConditions(g), c.events(ctx, ns))
	}
	prefill := c.podsBy(ctx, t, ns, batchv1.JobNameLabel+"=infer-prefill")
	if len(prefill) != 1 || len(prefill[0].Spec.SchedulingGates) == 0 || prefill[0].Spec.NodeName != "" {
		t.Fatalf("the prefill pod is not held gated while decode is missing:\n%s", c.describePods(ctx, ns))
	}
	if dc := getClaim(ctx, t, c, ns, "infer-domain"); dc.Status.Allocation != nil {
		t.Errorf("the domain claim was allocated before every role had its pods: %+v", dc.Status.Allocation)
	}
	cpg, err := c.Client().SchedulingV1alpha3().CompositePodGroups(ns).Get(ctx, "infer", metav1.GetOptions{})
	noErr(t, err)
	want := []gangv1.Role{{Name: "infer-prefill", Size: 1, PodGroupName: "infer-prefill"}, {Name: "infer-decode", Size: 2, PodGroupName: "infer-decode"}}
	if !metav1.IsControlledBy(g, cpg) || g.Spec.CompositePodGroupName != "infer" || g.Spec.DomainClaimName != "infer-domain" || g.Spec.Size != 3 || fmt.Sprint(g.Spec.Roles) != fmt.Sprint(want) {
		t.Errorf("gang of the CompositePodGroup: owners %+v, spec %+v; want owned by it, roles %+v sharing infer-domain", g.OwnerReferences, g.Spec, want)
	}

	if err := c.Apply(ctx, []byte(last)); err != nil {
		t.Fatalf("apply the decode Job: %v", err)
	}
	pods := c.waitAllRunning(ctx, t, ns, "app=infer", 3, 3*time.Minute)
	g = gs.waitCondition(ctx, t, ns, "infer", gangv1.ConditionRunning, metav1.ConditionTrue, time.Minute)
	nodes := map[string]bool{}
	got := map[string]string{} // rank -> role/role rank/role size
	for _, p := range pods {
		env := c.workerEnv(&p)
		nodes[p.Spec.NodeName] = true
		got[env[gangv1.EnvGangRank]] = fmt.Sprintf("%s/%s/%s", env[gangv1.EnvRole], env[gangv1.EnvRoleRank], env[gangv1.EnvRoleSize])
		if group := *p.Spec.SchedulingGroup.PodGroupName; env[gangv1.EnvRole] != group || env[gangv1.EnvDomain] != cliqueA || env[gangv1.EnvGangSize] != "3" {
			t.Errorf("pod %s of PodGroup %s on %s sees %s=%q %s=%q %s=%q; want its PodGroup, %s and 3", p.Name, group, p.Spec.NodeName,
				gangv1.EnvRole, env[gangv1.EnvRole], gangv1.EnvDomain, env[gangv1.EnvDomain], gangv1.EnvGangSize, env[gangv1.EnvGangSize], cliqueA)
		}
		var imex []string
		for _, rc := range c.Node(p.Spec.NodeName).Containers() {
			if rc.PodUID == string(p.UID) && rc.Name == "worker" {
				imex = deviceNodes(rc, imexRE)
			}
		}
		if len(imex) != 1 {
			t.Errorf("pod %s has IMEX channel devices %v, want one", p.Name, imex)
		}
	}
	if hosts := slices.Sorted(maps.Keys(nodes)); !slices.Equal(hosts, []string{"tray-a1", "tray-a2", "tray-a3"}) {
		t.Errorf("the servers run on %v, want the three trays of clique A", hosts)
	}
	if want := map[string]string{"0": "infer-prefill/0/1", "1": "infer-decode/0/2", "2": "infer-decode/1/2"}; !maps.Equal(got, want) {
		t.Errorf("rank -> role/role rank/role size %v, want %v", got, want)
	}
	// The claim is reserved for every server: for its pod, or (the
	// resourceclaim controller's way with a claim PodGroups list) for its
	// PodGroup, which kubelets with DRAWorkloadResourceClaims accept.
	dc := getClaim(ctx, t, c, ns, "infer-domain")
	reserved := map[string]bool{}
	for _, r := range dc.Status.ReservedFor {
		reserved[r.Resource+"/"+r.Name] = true
	}
	for _, p := range pods {
		if !reserved["pods/"+p.Name] && !reserved["podgroups/"+*p.Spec.SchedulingGroup.PodGroupName] {
			t.Errorf("domain claim reserved for %+v: neither pod %s nor its PodGroup", dc.Status.ReservedFor, p.Name)
		}
	}
	if r := dc.Status.Allocation.Devices.Results; len(r) != 1 || r[0].Pool != poolA {
		t.Errorf("domain claim allocated %+v, want one channel of %s", r, poolA)
	}
	for _, child := range []string{"infer-prefill", "infer-decode"} {
		if _, err := gs.dyn.Resource(gangv1.GroupVersionResource).Namespace(ns).Get(ctx, child, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			t.Errorf("child PodGroup %s has a gang of its own: %v", child, err)
		}
	}
	t.Logf("CompositePodGroup infer runs as one gang on %v in %s", g.Status.Nodes, g.Status.Domain)

	// The Jobs and the CompositePodGroup go; the garbage collector takes
	// the gang with it.
	c.deleteJob(ctx, t, ns, "infer-prefill")
	c.deleteJob(ctx, t, ns, "infer-decode")
	noErr(t, c.Client().SchedulingV1alpha3().CompositePodGroups(ns).Delete(ctx, "infer", metav1.DeleteOptions{}))
	err = wait.PollUntilContextTimeout(ctx, 300*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		_, err := gs.dyn.Resource(gangv1.GroupVersionResource).Namespace(ns).Get(ctx, "infer", metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	})
	if err != nil {
		t.Errorf("the deleted CompositePodGroup's gang is not gone: %v", err)
	}
}
