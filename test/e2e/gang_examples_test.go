package e2e

import (
	"context"
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"testing"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/driver/domain"
)

// rackLabel is the node label the rack example's controller groups by.
const rackLabel = "topology.kubernetes.io/rack"

// TestGangExamplesRunOnTheLocalCluster applies deployments/examples/gang as a
// user would, on two GB200 trays of one NVLink clique (rack-1) and two DGX
// H100s (rack-2), with tessera-controller grouping nodes by rack too. The
// NVLink Job (two workers of a whole tray each) can only start on the
// trays, with an IMEX channel; the rack Job (two workers of eight GPUs) only
// in rack-2. Both start whole, each worker with its rank. Then the NVLink Job
// runs again, declared with the PodGroup API (deployments/examples/podgroup),
// and its gang and group claim go with the PodGroup. Then the policy
// examples, while the rack Job fills rack-2: the spread Job runs one worker
// on each tray (packed, both would share one), and the launcher-workers
// gang runs in the clique with ranks by role (launcher 0, workers 1 and 2)
// and each container's role env.
func TestGangExamplesRunOnTheLocalCluster(t *testing.T) {
	t.Parallel()
	const clique = "5d1c9a40-77e2-4c61-8f0e-2b9d3a6c4e10.7"
	c := startTessera(t,
		gpuNodeSpec{name: "tray-1", profile: "gb200-nvl72-tray", clique: clique},
		gpuNodeSpec{name: "tray-2", profile: "gb200-nvl72-tray", clique: clique},
		gpuNodeSpec{name: "dgx-1", profile: "dgx-h100"},
		gpuNodeSpec{name: "dgx-2", profile: "dgx-h100"},
	)
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
	defer cancel()
	// An operator labels the racks (a kubelet may not set kubernetes.io
	// labels on itself); dgx-2 joins rack-2 after the controller runs, and
	// the rack's pool follows.
	label := func(node, rack string) {
		patch := fmt.Sprintf(`{"metadata":{"labels":{%q:%q}}}`, rackLabel, rack)
		noErr(t, ok(c.Client().CoreV1().Nodes().Patch(ctx, node, types.MergePatchType, []byte(patch), metav1.PatchOptions{})))
	}
	label("tray-1", "rack-1")
	label("tray-2", "rack-1")
	label("dgx-1", "rack-2")
	ctl := installAndStartController(ctx, t, c.Cluster, rackLabel)
	nvlinkPool, rack1, rack2 := domain.PoolName(domain.KindNVLink, clique), domain.PoolName(domain.KindTopology, "rack-1"), domain.PoolName(domain.KindTopology, "rack-2")
	waitDomains(ctx, t, c, map[string]int{nvlinkPool: 2, rack1: 2, rack2: 1})
	label("dgx-2", "rack-2")
	waitDomains(ctx, t, c, map[string]int{nvlinkPool: 2, rack1: 2, rack2: 2})

	dir := filepath.Join(examplesDir, gangExamples)
	files, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
	names := []string{"backfill-job.yaml", "elastic-training-job.yaml", "launcher-workers-job.yaml", "nvlink-training-job.yaml", "priority-training-job.yaml", "rack-training-job.yaml", "spread-training-job.yaml"}
	if err != nil || !slices.Equal(files, prefixed(dir, names)) {
		t.Fatalf("gang examples %v (%v), want %v: a new example needs its check here", files, err, names)
	}
	applyFile(ctx, t, c, filepath.Join(dir, "nvlink-training-job.yaml"))
	applyFile(ctx, t, c, filepath.Join(dir, "rack-training-job.yaml"))

	gs := newGangs(t, c.Cluster)
	type example struct {
		job, domainClaim, pool, domainEnv string
		nodes                             []string
	}
	check := func(want example) *gangv1.Gang {
		pods := c.waitAllRunning(ctx, t, metav1.NamespaceDefault, batchv1.JobNameLabel+"="+want.job, 2, 3*time.Minute)
		g := gs.waitCondition(ctx, t, metav1.NamespaceDefault, want.job, gangv1.ConditionRunning, metav1.ConditionTrue, time.Minute)
		if !slices.Equal(g.Status.Nodes, want.nodes) {
			t.Errorf("gang %s placed on %v, want %v", want.job, g.Status.Nodes, want.nodes)
		}
		if want.domainClaim == "" {
			want.domainClaim = g.Spec.DomainClaimName
		}
		dc := getClaim(ctx, t, c, metav1.NamespaceDefault, want.domainClaim)
		if r := dc.Status.Allocation.Devices.Results; len(r) != 1 || r[0].Pool != want.pool {
			t.Errorf("gang %s: domain claim allocated %+v, want a channel of %s", want.job, r, want.pool)
		}
		ranks := map[string]bool{}
		for _, p := range pods {
			var env map[string]string
			var imex []string
			for _, rc := range c.Node(p.Spec.NodeName).Containers() {
				if rc.PodUID == string(p.UID) && rc.Name == "worker" {
					env, imex = rc.EnvMap(), deviceNodes(rc, imexRE)
				}
			}
			if env == nil {
				t.Fatalf("gang %s: no worker container of pod %s recorded on %s", want.job, p.Name, p.Spec.NodeName)
			}
			if env[gangv1.EnvGangSize] != "2" || env[gangv1.EnvDomain] != want.domainEnv || env[gangv1.EnvGangRank] != p.Labels[batchv1.JobCompletionIndexAnnotation] {
				t.Errorf("gang %s: pod %s (index %s) sees %s=%q %s=%q %s=%q, want 2, %s and its index", want.job, p.Name, p.Labels[batchv1.JobCompletionIndexAnnotation],
					gangv1.EnvGangSize, env[gangv1.EnvGangSize], gangv1.EnvDomain, env[gangv1.EnvDomain], gangv1.EnvGangRank, env[gangv1.EnvGangRank], want.domainEnv)
			}
			// Only NVLink domains have an IMEX channel device.
			if (len(imex) == 1) != (want.pool == nvlinkPool) {
				t.Errorf("gang %s: pod %s has IMEX channel devices %v", want.job, p.Name, imex)
			}
			if env[gangv1.EnvGangRank] != "" {
				ranks[env[gangv1.EnvGangRank]] = true
			}
		}
		if len(ranks) != 2 {
			t.Errorf("gang %s: ranks %v, want two distinct", want.job, ranks)
		}
		t.Logf("example gang %s runs on %v in %s", want.job, g.Status.Nodes, g.Status.Domain)
		return g
	}
	check(example{"train", "train-domain", nvlinkPool, clique, []string{"tray-1", "tray-2"}})
	check(example{"rack-train", "rack-train-domain", rack2, "rack-2", []string{"dgx-1", "dgx-2"}})
	if running := ctl.counter(t, `tessera_gangs{state="Running"}`); running != 2 {
		t.Errorf("controller metrics: %v gangs running, want 2", running)
	}

	// The same NVLink Job declared with the PodGroup API, once the trays
	// are free again.
	gs.delete(ctx, t, metav1.NamespaceDefault, "train")
	c.deleteJob(ctx, t, metav1.NamespaceDefault, "train")
	applyFile(ctx, t, c, filepath.Join(examplesDir, podGroupExamples, "training-job.yaml"))
	pgs := c.Client().SchedulingV1beta1().PodGroups(metav1.NamespaceDefault)
	pg, err := pgs.Get(ctx, "pg-train", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	g := check(example{job: "pg-train", pool: nvlinkPool, domainEnv: clique, nodes: []string{"tray-1", "tray-2"}})
	if !metav1.IsControlledBy(g, pg) || g.Spec.PodGroupName != "pg-train" || g.Spec.Size != 2 {
		t.Errorf("gang of the PodGroup: owners %+v, spec %+v; want owned by PodGroup pg-train, its 2 pods", g.OwnerReferences, g.Spec)
	}
	// The group's claim: made once from the template for the PodGroup,
	// reserved for both pods (so that any kubelet prepares it).
	dc := getClaim(ctx, t, c, metav1.NamespaceDefault, g.Spec.DomainClaimName)
	if !metav1.IsControlledBy(dc, pg) || len(dc.Status.ReservedFor) != 2 {
		t.Errorf("domain claim %s: owners %+v, reserved for %+v; want the PodGroup's, reserved for its 2 pods", dc.Name, dc.OwnerReferences, dc.Status.ReservedFor)
	}
	// The PodGroup's Job and then the PodGroup go; the garbage collector
	// takes the gang and the group claim with it, and the devices are free.
	c.deleteJob(ctx, t, metav1.NamespaceDefault, "pg-train")
	noErr(t, pgs.Delete(ctx, "pg-train", metav1.DeleteOptions{}))
	err = wait.PollUntilContextTimeout(ctx, 300*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		_, gerr := gs.dyn.Resource(gangv1.GroupVersionResource).Namespace(metav1.NamespaceDefault).Get(ctx, "pg-train", metav1.GetOptions{})
		_, cerr := c.Client().ResourceV1().ResourceClaims(metav1.NamespaceDefault).Get(ctx, dc.Name, metav1.GetOptions{})
		return apierrors.IsNotFound(gerr) && apierrors.IsNotFound(cerr), nil
	})
	if err != nil {
		t.Errorf("gang and group claim of the deleted PodGroup not gone: %v", err)
	}

	// The policy examples, while rack-train fills both DGX nodes: the
	// spread Job on one GPU of each tray, where packed it would share one;
	// then the launcher and its workers together in the clique, ranked by
	// role.
	applyFile(ctx, t, c, filepath.Join(dir, "spread-training-job.yaml"))
	pods := c.waitAllRunning(ctx, t, metav1.NamespaceDefault, batchv1.JobNameLabel+"=spread-train", 2, 3*time.Minute)
	g = gs.waitCondition(ctx, t, metav1.NamespaceDefault, "spread-train", gangv1.ConditionRunning, metav1.ConditionTrue, time.Minute)
	hosts := []string{pods[0].Spec.NodeName, pods[1].Spec.NodeName}
	slices.Sort(hosts)
	if !slices.Equal(hosts, []string{"tray-1", "tray-2"}) || !slices.Equal(g.Status.Nodes, hosts) {
		t.Errorf("spread gang: workers on %v, gang status nodes %v; want one on each tray", hosts, g.Status.Nodes)
	}
	t.Logf("example gang spread-train runs on %v", hosts)

	applyFile(ctx, t, c, filepath.Join(dir, "launcher-workers-job.yaml"))
	pods = c.waitAllRunning(ctx, t, metav1.NamespaceDefault, "app=lw-train", 3, 3*time.Minute)
	g = gs.waitCondition(ctx, t, metav1.NamespaceDefault, "lw-train", gangv1.ConditionRunning, metav1.ConditionTrue, time.Minute)
	if dc := getClaim(ctx, t, c, metav1.NamespaceDefault, "lw-domain"); len(dc.Status.Allocation.Devices.Results) != 1 || dc.Status.Allocation.Devices.Results[0].Pool != nvlinkPool {
		t.Errorf("launcher-workers gang: domain claim allocated %+v, want a channel of %s", dc.Status.Allocation.Devices.Results, nvlinkPool)
	}
	got := map[string]string{} // rank -> role/role rank/role size
	for _, p := range pods {
		env := c.workerEnv(&p)
		role := p.Labels[batchv1.JobNameLabel]
		got[env[gangv1.EnvGangRank]] = fmt.Sprintf("%s/%s/%s", env[gangv1.EnvRole], env[gangv1.EnvRoleRank], env[gangv1.EnvRoleSize])
		if !slices.Contains([]string{"tray-1", "tray-2"}, p.Spec.NodeName) || (role == "lw-launcher") != (env[gangv1.EnvRole] == "launcher") {
			t.Errorf("launcher-workers gang: pod %s of Job %s on %s sees role %q", p.Name, role, p.Spec.NodeName, env[gangv1.EnvRole])
		}
	}
	if want := map[string]string{"0": "launcher/0/1", "1": "workers/0/2", "2": "workers/1/2"}; !maps.Equal(got, want) {
		t.Errorf("launcher-workers gang: rank -> role/role rank/role size %v, want %v", got, want)
	}
	t.Logf("example gang lw-train runs on %v in %s", g.Status.Nodes, g.Status.Domain)

	// The elastic Job (four workers of two GPUs, minSize 2) once the
	// launcher and its workers are gone: with spread-train's worker on
	// each tray, one of its workers fits per tray, so it starts with two
	// (indexes 0 and 1, the lowest ranks) and the others wait gated; once
	// spread-train ends, they join the same placement.
	gs.delete(ctx, t, metav1.NamespaceDefault, "lw-train")
	c.deleteJob(ctx, t, metav1.NamespaceDefault, "lw-launcher")
	c.deleteJob(ctx, t, metav1.NamespaceDefault, "lw-workers")
	applyFile(ctx, t, c, filepath.Join(dir, "elastic-training-job.yaml"))
	elastic := func(index string) *corev1.Pod {
		list, err := c.Client().CoreV1().Pods(metav1.NamespaceDefault).List(ctx, metav1.ListOptions{LabelSelector: batchv1.JobNameLabel + "=elastic-train," + batchv1.JobCompletionIndexAnnotation + "=" + index})
		if err != nil || len(list.Items) != 1 {
			return nil
		}
		return &list.Items[0]
	}
	err = wait.PollUntilContextTimeout(ctx, 300*time.Millisecond, 3*time.Minute, true, func(ctx context.Context) (bool, error) {
		p0, p1 := elastic("0"), elastic("1")
		return p0 != nil && p1 != nil && p0.Status.Phase == corev1.PodRunning && p1.Status.Phase == corev1.PodRunning, nil
	})
	if err != nil {
		t.Fatalf("the elastic gang did not start with its two lowest ranks:\n%s\nevents:\n%s", c.describePods(ctx, metav1.NamespaceDefault), c.events(ctx, metav1.NamespaceDefault))
	}
	for _, index := range []string{"2", "3"} {
		if p := elastic(index); p == nil || len(p.Spec.SchedulingGates) == 0 || p.Spec.NodeName != "" {
			t.Fatalf("elastic worker %s not left gated while there is no room:\n%s", index, c.describePods(ctx, metav1.NamespaceDefault))
		}
	}
	placement := gs.get(ctx, t, metav1.NamespaceDefault, "elastic-train").Annotations[gangv1.AnnotationCommitted]
	gs.delete(ctx, t, metav1.NamespaceDefault, "spread-train")
	c.deleteJob(ctx, t, metav1.NamespaceDefault, "spread-train")
	pods = c.waitAllRunning(ctx, t, metav1.NamespaceDefault, batchv1.JobNameLabel+"=elastic-train", 4, 3*time.Minute)
	for _, p := range pods {
		env := c.workerEnv(&p)
		index := p.Labels[batchv1.JobCompletionIndexAnnotation]
		if env[gangv1.EnvGangRank] != index || env[gangv1.EnvGangSize] != "4" || p.Annotations[gangv1.AnnotationPlacement] != placement || !slices.Contains([]string{"tray-1", "tray-2"}, p.Spec.NodeName) {
			t.Errorf("elastic worker %s on %s: %s=%q %s=%q, placement %q (first %q); want its index, 4 and one placement on the trays", index, p.Spec.NodeName,
				gangv1.EnvGangRank, env[gangv1.EnvGangRank], gangv1.EnvGangSize, env[gangv1.EnvGangSize], p.Annotations[gangv1.AnnotationPlacement], placement)
		}
	}
	if !c.hasEvent(ctx, metav1.NamespaceDefault, "elastic-train", gangv1.ReasonGrown) {
		t.Errorf("no %s event on the elastic gang", gangv1.ReasonGrown)
	}
	t.Logf("example gang elastic-train started with 2 workers and grew to 4 in placement %s", placement)

	// The backfill Job, once the elastic one is gone: with no reservation
	// it runs as any pod, its claim tolerating reservations.
	gs.delete(ctx, t, metav1.NamespaceDefault, "elastic-train")
	c.deleteJob(ctx, t, metav1.NamespaceDefault, "elastic-train")
	applyFile(ctx, t, c, filepath.Join(dir, "backfill-job.yaml"))
	backfill := c.waitAllRunning(ctx, t, metav1.NamespaceDefault, batchv1.JobNameLabel+"=backfill", 1, 3*time.Minute)[0]
	if claim := c.claimOf(ctx, t, &backfill, "gpu"); len(claim.Spec.Devices.Requests) != 1 || len(claim.Spec.Devices.Requests[0].Exactly.Tolerations) != 1 || claim.Spec.Devices.Requests[0].Exactly.Tolerations[0].Key != gangv1.TaintReserved {
		t.Errorf("backfill pod's claim tolerates %+v, want %s", claim.Spec.Devices.Requests, gangv1.TaintReserved)
	}

	// The urgent Job: rack-train (priority 0) fills rack-2, so the urgent
	// gang preempts it whole and runs there.
	rackTrain := map[types.UID]bool{}
	for _, p := range c.waitAllRunning(ctx, t, metav1.NamespaceDefault, batchv1.JobNameLabel+"=rack-train", 2, time.Minute) {
		rackTrain[p.UID] = true
	}
	applyFile(ctx, t, c, filepath.Join(dir, "priority-training-job.yaml"))
	pods = c.waitAllRunning(ctx, t, metav1.NamespaceDefault, batchv1.JobNameLabel+"=urgent-train", 2, 3*time.Minute)
	for _, p := range pods {
		if !slices.Contains([]string{"dgx-1", "dgx-2"}, p.Spec.NodeName) {
			t.Errorf("urgent worker %s on %s, want rack-2", p.Name, p.Spec.NodeName)
		}
	}
	if !c.hasEvent(ctx, metav1.NamespaceDefault, "urgent-train", gangv1.ReasonPreempting) {
		t.Errorf("no %s event on urgent-train", gangv1.ReasonPreempting)
	}
	list, err := c.Client().CoreV1().Pods(metav1.NamespaceDefault).List(ctx, metav1.ListOptions{LabelSelector: batchv1.JobNameLabel + "=rack-train"})
	noErr(t, err)
	for _, p := range list.Items {
		if rackTrain[p.UID] && p.DeletionTimestamp == nil && p.Status.Phase == corev1.PodRunning {
			t.Errorf("rack-train worker %s still runs beside the urgent gang", p.Name)
		}
	}
	t.Logf("example gang urgent-train preempted rack-train and runs on rack-2")
}

// prefixed joins dir to each of names.
func prefixed(dir string, names []string) []string {
	out := make([]string, len(names))
	for i, n := range names {
		out[i] = filepath.Join(dir, n)
	}
	return out
}

// workerEnv is the environment of the example pod's container "worker" as
// its node's runtime recorded it; nil when none was.
func (c *tesseraCluster) workerEnv(p *corev1.Pod) map[string]string {
	for _, rc := range c.Node(p.Spec.NodeName).Containers() {
		if rc.PodUID == string(p.UID) && rc.Name == "worker" {
			return rc.EnvMap()
		}
	}
	return nil
}
