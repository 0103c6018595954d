package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/utils/ptr"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/controller/domains"
	"github.com/tessera-dev/tessera/controller/gang"
	"github.com/tessera-dev/tessera/driver/domain"
)

// Two multi-node NVLink cliques of GB200 trays (4 GPUs each): A has four
// trays (16 GPUs), B one (4 GPUs).
const (
	cliqueA = "7b2f0c5e-1d4a-4e8b-9c3f-0a6d5e4b3c21.1"
	cliqueB = "7b2f0c5e-1d4a-4e8b-9c3f-0a6d5e4b3c21.2"
)

var (
	poolA   = domain.PoolName(domain.KindNVLink, cliqueA)
	poolB   = domain.PoolName(domain.KindNVLink, cliqueB)
	imexRE  = regexp.MustCompile(`^/dev/nvidia-caps-imex-channels/channel[0-9]+$`)
	jobName = "batch.kubernetes.io/job-name"
)

// gangTrays are the nodes of a cluster of TestGangPlacement: five GB200
// trays in two cliques.
var gangTrays = []gpuNodeSpec{
	{name: "tray-a1", profile: "gb200-nvl72-tray", clique: cliqueA},
	{name: "tray-a2", profile: "gb200-nvl72-tray", clique: cliqueA},
	{name: "tray-a3", profile: "gb200-nvl72-tray", clique: cliqueA},
	{name: "tray-a4", profile: "gb200-nvl72-tray", clique: cliqueA},
	{name: "tray-b1", profile: "gb200-nvl72-tray", clique: cliqueB},
}

// startGangEnv starts a cluster of gangTrays with the real kubelet plugin
// on each and tessera-controller running as its own service account, and
// waits until the controller publishes both cliques' domains.
func startGangEnv(ctx context.Context, t *testing.T) gangEnv {
	t.Helper()
	c := startTessera(t, gangTrays...)
	kubeconfig, err := installController(ctx, c.Cluster)
	if err != nil {
		t.Fatal(err)
	}
	ctl := startController(t, kubeconfig, "", nil)
	waitDomains(ctx, t, c, map[string]int{poolA: 4, poolB: 1})
	return gangEnv{parent: t, c: c, gs: newGangs(t, c.Cluster), kubeconfig: kubeconfig, ctl: &ctl}
}

// run runs f as t's subtest name on e's cluster; if it fails, its part of
// the cluster's logs is kept (LogsOnFailure).
func (e gangEnv) run(ctx context.Context, t *testing.T, name string, f func(context.Context, *testing.T)) bool {
	return t.Run(name, func(t *testing.T) {
		e.c.LogsOnFailure(t)
		f(ctx, t)
	})
}

// TestGangPlacement runs gangs on five GB200 trays in two cliques with the
// real kubelet plugin on each and tessera-controller as its own service
// account. The subtests run in two sequences side by side, each on a
// cluster of its own (startGangEnv): they spend most of their time waiting
// on the controller's grace, the Job controller's back-off and PodGC, and
// one cluster ran them one after another for a quarter of an hour.
// Within a sequence they share the cluster and run in order; each cleans up
// after itself.
func TestGangPlacement(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Minute)
	defer cancel()
	e := startGangEnv(ctx, t)
	second := startGangEnv(ctx, t)
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() {
		for _, s := range []struct {
			name string
			f    func(context.Context, *testing.T)
		}{
			{"AMemberRefusedAtPrepareForADeviceAllocatedTwiceHasTheGangPlacedAgainWithoutIt", second.refusedAtPrepare},
			{"AMemberRefusedAtPrepareWhoseDeviceIsFreedRunsInItsPlacementBeforeTheKubeletsResync", second.refusedThenFreed},
			{"ASelectorChangedMidPlacementStillFreesWhatTheCutPlacementWrote", second.selectorChangedMidPlacement},
			{"AStreamOfSmallPodsRacingTheGangForItsCliqueNeverLeavesHardwareHeldTwice", second.smallPodStream},
			{"AHighPriorityGangPreemptsAWholeLowPriorityGangInOneDomainAndNothingElse", second.preemptsAWholeGang},
			{"AReservedGangStartsWhileSmallPodsKeepArrivingAndItsBackfillIsEvictedAtTheStart", second.reservesAndBackfills},
			{"AnElasticGangStartsAtMinGrowsLosesAMemberAndGoesOn", second.elasticGrowsAndShrinks},
			{"AnElasticPodGroupStartsAtMinCountAndGrowsOnTheRealScheduler", second.elasticPodGroupGrows},
			{"ALeaderWorkerGangKeepsItsLeaderWhenWorkersArePreempted", second.leaderKeptWhenWorkersPreempted},
			{"ANodeLeavingLosesItsMembersAndTheGangIsPlacedAgainElsewhere", second.nodeLeaves},
		} {
			second.run(ctx, t, s.name, s.f)
		}
	})

	c, gs, kubeconfig, parent := e.c, e.gs, e.kubeconfig, t
	client := c.Client()

	t.Run("SixteenMembersOfAnIndexedJobRunInOneCliqueWithDistinctRanks", func(t *testing.T) {
		c.LogsOnFailure(t)
		const ns = "train16"
		c.newNamespace(ctx, t, ns)
		c.createTemplates(ctx, t, gpuTemplate(ns, "one-gpu", 1))
		noErr(t, ok(client.ResourceV1().ResourceClaims(ns).Create(ctx, domainClaim(ns, "train-domain"), metav1.CreateOptions{})))
		pods, g := c.runJobGang(ctx, t, gs, ns, "train", "one-gpu", "train-domain", 16)
		dc := getClaim(ctx, t, c, ns, "train-domain")
		results := dc.Status.Allocation.Devices.Results
		if len(results) != 1 || results[0].Pool != poolA {
			t.Fatalf("domain claim allocated %+v, want one channel of %s", results, poolA)
		}
		channel, _ := domain.ParseDevice(results[0].Device)
		if g.Status.Domain != poolA+"/"+results[0].Device {
			t.Errorf("gang status domain %q, want %s/%s", g.Status.Domain, poolA, results[0].Device)
		}
		ranks := map[string]bool{}
		for i := range pods {
			pod := &pods[i]
			rc := c.containerOf(t, pod)
			claim := c.claimOf(ctx, t, pod, "gpu")
			checkGPUContainer(t, c.nodes[pod.Spec.NodeName], rc, allocatedDevices(claim))
			wantIMEX := []string{fmt.Sprintf("/dev/nvidia-caps-imex-channels/channel%d", channel)}
			if got := deviceNodes(rc, imexRE); !slices.Equal(got, wantIMEX) {
				t.Errorf("pod %s: IMEX channel nodes %v, want %v", pod.Name, got, wantIMEX)
			}
			env := rc.EnvMap()
			rank := env[gangv1.EnvGangRank]
			if env[gangv1.EnvGang] != ns+"/train" || env[gangv1.EnvGangSize] != "16" || rank != pod.Labels["batch.kubernetes.io/job-completion-index"] {
				t.Errorf("pod %s (index %s): gang env %s=%q %s=%q %s=%q, want %s/train, 16 and its index", pod.Name, pod.Labels["batch.kubernetes.io/job-completion-index"],
					gangv1.EnvGang, env[gangv1.EnvGang], gangv1.EnvGangSize, env[gangv1.EnvGangSize], gangv1.EnvGangRank, rank, ns)
			}
			if env[gangv1.EnvDomain] != cliqueA || env[gangv1.EnvChannel] != strconv.Itoa(channel) {
				t.Errorf("pod %s: domain env %s=%q %s=%q, want %s and %d", pod.Name, gangv1.EnvDomain, env[gangv1.EnvDomain], gangv1.EnvChannel, env[gangv1.EnvChannel], cliqueA, channel)
			}
			ranks[rank] = true
		}
		if len(ranks) != 16 {
			t.Errorf("ranks %v: want 16 distinct", ranks)
		}
		t.Logf("16 members run on %v in %s, IMEX channel %d", g.Status.Nodes, g.Status.Domain, channel)
	})

	t.Run("ASpreadGangRunsOneMemberPerTrayWhereAPackedOneWouldShareATray", func(t *testing.T) {
		c.LogsOnFailure(t)
		const ns = "spread"
		c.newNamespace(ctx, t, ns)
		c.createTemplates(ctx, t, gpuTemplate(ns, "one-gpu", 1))
		noErr(t, ok(client.ResourceV1().ResourceClaims(ns).Create(ctx, domainClaim(ns, "spread-domain"), metav1.CreateOptions{})))
		// Packed, three one-GPU members would share tray-b1 (clique B is the
		// smallest that fits); at most one per host, they need clique A.
		g := labelGang(ns, "spread", 3, "spread-domain")
		g.Spec.Placement = &gangv1.Placement{Policy: gangv1.PolicySpread, TopologyKey: corev1.LabelHostname, MaxPerValue: 1}
		t.Cleanup(func() { c.deleteGangAndMembers(context.WithoutCancel(ctx), t, gs, ns, "spread") })
		gs.create(ctx, t, g)
		c.createMembers(ctx, t, ns, "spread", "one-gpu", "spread-domain", 3)
		pods := c.waitAllRunning(ctx, t, ns, "gang=spread", 3, 3*time.Minute)
		nodes := map[string]bool{}
		for _, p := range pods {
			nodes[p.Spec.NodeName] = true
		}
		if len(nodes) != 3 || nodes["tray-b1"] {
			t.Errorf("members run on %v, want three distinct trays of clique A", nodes)
		}
		g = gs.waitCondition(ctx, t, ns, "spread", gangv1.ConditionRunning, metav1.ConditionTrue, time.Minute)
		if reason := conditionReason(g, gangv1.ConditionPlaced); reason != gangv1.ReasonPlaced || !strings.HasPrefix(g.Status.Domain, poolA+"/") {
			t.Errorf("gang placed in %q with reason %s, want %s and %s:\n%s", g.Status.Domain, reason, poolA, gangv1.ReasonPlaced, describeConditions(g))
		}
	})

	t.Run("GangThatCannotFitHoldsNothingWhileSmallerWorkSchedulesAndStartsWhenCapacityFrees", func(t *testing.T) {
		c.LogsOnFailure(t)
		const ns = "nofit"
		c.newNamespace(ctx, t, ns)
		c.createTemplates(ctx, t, gpuTemplate(ns, "one-gpu", 1))
		c.createTemplates(ctx, t, gpuTemplate(ns, "four-gpus", 4))
		noErr(t, ok(client.ResourceV1().ResourceClaims(ns).Create(ctx, domainClaim(ns, "big-domain"), metav1.CreateOptions{})))
		// A blocker takes a whole tray of clique A: 12 GPUs are left there.
		blocker := c.createAndRun(ctx, t, onNode(newGPUPod(ns, "blocker", gpuFrom("four-gpus")), "tray-a1"))
		t.Cleanup(func() { gs.delete(context.WithoutCancel(ctx), t, ns, "big") })
		gs.create(ctx, t, labelGang(ns, "big", 16, "big-domain"))
		c.createMembers(ctx, t, ns, "big", "one-gpu", "big-domain", 16)

		g := gs.waitCondition(ctx, t, ns, "big", gangv1.ConditionWaiting, metav1.ConditionTrue, time.Minute)
		err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
			g = gs.get(ctx, t, ns, "big")
			return conditionReason(g, gangv1.ConditionWaiting) == gangv1.ReasonNoDomainFits, nil
		})
		if err != nil {
			t.Fatalf("gang not waiting for lack of a domain:\n%s", describeConditions(g))
		}
		// What an operator's dashboard sees: a placement, and attempts that
		// found no domain.
		if placed, nofit := (*e.ctl).counter(t, `tessera_gang_placement_attempts_total{result="placed"}`), (*e.ctl).counter(t, `tessera_gang_placement_attempts_total{result="nofit"}`); placed < 1 || nofit < 1 {
			t.Errorf("controller metrics: %v placements and %v no-fit attempts, want at least one of each", placed, nofit)
		}
		if waiting := (*e.ctl).counter(t, `tessera_gangs{state="Waiting"}`); waiting != 1 {
			t.Errorf("controller metrics: %v gangs waiting, want 1", waiting)
		}
		why := conditionMessageOf(g, gangv1.ConditionWaiting)
		if !regexp.MustCompile(regexp.QuoteMeta(poolA) + `: room for 12 of 16 members`).MatchString(why) {
			t.Errorf("Waiting message %q does not name the closest domain %s and what it lacked (room for 12 of 16)", why, poolA)
		}
		if !c.hasEvent(ctx, ns, "big", gangv1.ReasonNoDomainFits) {
			t.Errorf("no %s event on the gang; events:\n%s", gangv1.ReasonNoDomainFits, c.events(ctx, ns))
		}
		c.checkHeldNothing(ctx, t, ns, c.gangPods(ctx, t, ns, "big"), "big-domain")
		// Work that fits is not blocked by the waiting gang (on clique B, so
		// that clique A is whole again once the blocker goes).
		small := c.createAndRun(ctx, t, onNode(newGPUPod(ns, "small", gpuFrom("one-gpu")), "tray-b1"))
		t.Logf("waiting: %s; a 1-GPU pod runs meanwhile on %s", why, small.Spec.NodeName)
		c.checkHeldNothing(ctx, t, ns, c.gangPods(ctx, t, ns, "big"), "big-domain")

		c.deletePodsAndWait(ctx, t, blocker)
		c.waitAllRunning(ctx, t, ns, "gang=big", 16, 3*time.Minute)
		g = gs.waitCondition(ctx, t, ns, "big", gangv1.ConditionPlaced, metav1.ConditionTrue, time.Minute)
		if !slices.Equal(g.Status.Nodes, []string{"tray-a1", "tray-a2", "tray-a3", "tray-a4"}) {
			t.Errorf("gang placed on %v, want the four trays of clique A", g.Status.Nodes)
		}
	})

	t.Run("TwoGangsCompeteForOneCliqueOneWaitsWholeAndTheSmallestFittingDomainIsChosen", func(t *testing.T) {
		c.LogsOnFailure(t)
		const ns = "compete"
		c.newNamespace(ctx, t, ns)
		c.createTemplates(ctx, t, gpuTemplate(ns, "one-gpu", 1))
		for _, name := range []string{"first", "second", "small"} {
			noErr(t, ok(client.ResourceV1().ResourceClaims(ns).Create(ctx, domainClaim(ns, name+"-domain"), metav1.CreateOptions{})))
			t.Cleanup(func() { gs.delete(context.WithoutCancel(ctx), t, ns, name) })
		}
		// Both need 12 GPUs: only clique A has them, and not for both.
		gs.create(ctx, t, labelGang(ns, "first", 12, "first-domain"))
		gs.create(ctx, t, labelGang(ns, "second", 12, "second-domain"))
		c.createMembers(ctx, t, ns, "first", "one-gpu", "first-domain", 12)
		c.createMembers(ctx, t, ns, "second", "one-gpu", "second-domain", 12)

		var winner, loser string
		err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
			for _, pair := range [][2]string{{"first", "second"}, {"second", "first"}} {
				w, l := gs.get(ctx, t, ns, pair[0]), gs.get(ctx, t, ns, pair[1])
				if conditionStatus(w, gangv1.ConditionPlaced) && conditionReason(l, gangv1.ConditionWaiting) == gangv1.ReasonNoDomainFits {
					winner, loser = pair[0], pair[1]
					return true, nil
				}
			}
			return false, nil
		})
		if err != nil {
			t.Fatalf("not one gang placed and the other waiting:\nfirst:\n%ssecond:\n%s", describeConditions(gs.get(ctx, t, ns, "first")), describeConditions(gs.get(ctx, t, ns, "second")))
		}
		c.waitAllRunning(ctx, t, ns, "gang="+winner, 12, 3*time.Minute)
		c.checkHeldNothing(ctx, t, ns, c.gangPods(ctx, t, ns, loser), loser+"-domain")
		t.Logf("%s placed, %s waits: %s", winner, loser, conditionMessageOf(gs.get(ctx, t, ns, loser), gangv1.ConditionWaiting))

		// Clique A has 4 GPUs left and clique B 4: both fit a gang of four,
		// and the smaller (B, one tray) is chosen.
		gs.create(ctx, t, labelGang(ns, "small", 4, "small-domain"))
		c.createMembers(ctx, t, ns, "small", "one-gpu", "small-domain", 4)
		c.waitAllRunning(ctx, t, ns, "gang=small", 4, 3*time.Minute)
		g := gs.waitCondition(ctx, t, ns, "small", gangv1.ConditionPlaced, metav1.ConditionTrue, time.Minute)
		if !slices.Equal(g.Status.Nodes, []string{"tray-b1"}) || len(g.Status.Domain) < len(poolB) || g.Status.Domain[:len(poolB)] != poolB {
			t.Errorf("small gang placed in %s on %v, want the smallest fitting domain %s on tray-b1", g.Status.Domain, g.Status.Nodes, poolB)
		}
		c.checkHeldNothing(ctx, t, ns, c.gangPods(ctx, t, ns, loser), loser+"-domain")

		// Once the winner is gone, the loser is placed whole.
		c.deleteGangAndMembers(ctx, t, gs, ns, winner)
		c.waitAllRunning(ctx, t, ns, "gang="+loser, 12, 3*time.Minute)
	})

	t.Run("ControllerKilledMidPlacementEndsPlacedOrRolledBackNeverHalf", func(t *testing.T) {
		c.LogsOnFailure(t)
		if err := (*e.ctl).stop(); err != nil {
			t.Fatalf("stop the controller: %v", err)
		}
		defer func() { *e.ctl = startController(parent, kubeconfig, "", nil) }()
		for _, tc := range []struct {
			name, step string
			after      int32 // interrupt at the after-th time step is reached
		}{
			{"crash", gang.StepClaimWritten, 3},
			{"commit", gang.StepRelease, 1},
		} {
			t.Run(tc.name, func(t *testing.T) {
				c.LogsOnFailure(t)
				ns := "kill-" + tc.name
				c.newNamespace(ctx, t, ns)
				c.createTemplates(ctx, t, gpuTemplate(ns, "one-gpu", 1))
				noErr(t, ok(client.ResourceV1().ResourceClaims(ns).Create(ctx, domainClaim(ns, "g-domain"), metav1.CreateOptions{})))
				// However the case ends, its gang goes (a controller that is
				// not interrupted removes the finalizer) and no controller of
				// it outlives it, so that the other case starts from the
				// same cluster whether this one passed or not. Registered
				// before the dying controller's stop, so it runs after it.
				var live *runningController // the controller that finishes the placement
				t.Cleanup(func() {
					if live == nil {
						live = startController(t, kubeconfig, "", nil)
					}
					gs.delete(context.WithoutCancel(ctx), t, ns, "g")
					if err := live.stop(); err != nil {
						t.Errorf("stop the controller: %v", err)
					}
				})
				var reached atomic.Int32
				dying := startController(t, kubeconfig, "", func(step string) bool {
					return step == tc.step && reached.Add(1) == tc.after
				})
				gs.create(ctx, t, labelGang(ns, "g", 8, "g-domain"))
				c.createMembers(ctx, t, ns, "g", "one-gpu", "g-domain", 8)
				select {
				case <-dying.done:
				case <-time.After(2 * time.Minute):
					t.Fatalf("the controller was not interrupted at %s", tc.step)
				}
				// What the crash left: claims written for the placement
				// (the domain claim's channel allocated, the members'
				// claims annotated with their nodes), no member's claim
				// allocated (only the scheduler allocates those, after
				// the release), every member gated.
				g := gs.get(ctx, t, ns, "g")
				committed := g.Annotations[gangv1.AnnotationCommitted]
				id := committed
				if rec, ok := g.Annotations[gangv1.AnnotationUncommitted]; ok {
					var r gangv1.UncommittedPlacement
					noErr(t, json.Unmarshal([]byte(rec), &r))
					id = r.Placement
				}
				written := 0
				for _, p := range c.gangPods(ctx, t, ns, "g") {
					if len(p.Spec.SchedulingGates) == 0 || p.Spec.NodeName != "" {
						t.Errorf("member %s released before the crash", p.Name)
					}
					mc := getClaim(ctx, t, c, ns, *p.Status.ResourceClaimStatuses[0].ResourceClaimName)
					if mc.Status.Allocation != nil {
						t.Errorf("member %s's claim allocated before its release: only the scheduler allocates it", p.Name)
					}
					if id != "" && mc.Annotations[gangv1.AnnotationPlacement] == id {
						written++
					}
				}
				if dc := getClaim(ctx, t, c, ns, "g-domain"); dc.Status.Allocation != nil && dc.Annotations[gangv1.AnnotationPlacement] == id {
					written++
				}
				t.Logf("interrupted at %s with %d claims written for placement %q, committed %q", tc.step, written, id, committed)
				if written < int(tc.after) {
					t.Fatalf("%d claims written at the interruption: the test does not exercise a half placement", written)
				}
				if (committed != "") != (tc.step == gang.StepRelease) {
					t.Errorf("committed placement %q at step %s", committed, tc.step)
				}
				live = startController(t, kubeconfig, "", nil)
				pods := c.waitAllRunning(ctx, t, ns, "gang=g", 8, 3*time.Minute)
				g = gs.waitCondition(ctx, t, ns, "g", gangv1.ConditionPlaced, metav1.ConditionTrue, time.Minute)
				final := g.Annotations[gangv1.AnnotationCommitted]
				if tc.step == gang.StepRelease && final != committed {
					t.Errorf("a committed placement %s was placed again as %s instead of resumed", committed, final)
				}
				// Every claim of the gang belongs to the final placement,
				// and each member runs where that placement put it.
				for i := range pods {
					claim := c.claimOf(ctx, t, &pods[i], "gpu")
					if claim.Annotations[gangv1.AnnotationPlacement] != final || pods[i].Annotations[gangv1.AnnotationPlacement] != final || claim.Annotations[gangv1.AnnotationNode] != pods[i].Spec.NodeName {
						t.Errorf("member %s on %s runs with claim of placement %q for node %q (pod says %q), want %q", pods[i].Name, pods[i].Spec.NodeName, claim.Annotations[gangv1.AnnotationPlacement], claim.Annotations[gangv1.AnnotationNode], pods[i].Annotations[gangv1.AnnotationPlacement], final)
					}
				}
				if dc := getClaim(ctx, t, c, ns, "g-domain"); dc.Annotations[gangv1.AnnotationPlacement] != final || len(dc.Status.ReservedFor) != 8 {
					t.Errorf("domain claim of placement %q reserved for %d pods, want %q and 8", dc.Annotations[gangv1.AnnotationPlacement], len(dc.Status.ReservedFor), final)
				}
				c.deleteGangAndMembers(ctx, t, gs, ns, "g") // the controller removes its finalizer
				if err := live.stop(); err != nil {
					t.Fatal(err)
				}
			})
		}
	})

	e.run(ctx, t, "AGPUTakenBeforeTheReleaseKeepsEveryMemberFromBindingAndTheGangIsPlacedAgainWithoutIt", e.deviceTakenBeforeTheRelease)
	e.run(ctx, t, "AFailedMemberEvictsTheOthersAndTheJobsNewMembersArePlacedAgain", e.memberFails)
	e.run(ctx, t, "AMemberWhoseNodeFilledUpIsEvictedWithTheOthersAndTheGangPlacedWhereThereIsRoom", e.memberUnschedulable)
	e.run(ctx, t, "ADeletedGangLeavesRunningMembersAndFreesACutPlacement", e.gangDeleted)
}

// waitDomains waits until the controller publishes exactly these domain
// pools with these node counts.
func waitDomains(ctx context.Context, t testing.TB, c *tesseraCluster, want map[string]int) {
	t.Helper()
	var got map[string]int
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		list, err := c.Client().ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		got = map[string]int{}
		for _, s := range list.Items {
			if _, _, ok := domain.ParsePool(s.Spec.Pool.Name); ok {
				got[s.Spec.Pool.Name] = len(domains.HostsOf(s.Spec.NodeSelector))
			}
		}
		return fmt.Sprint(got) == fmt.Sprint(want), nil
	})
	if err != nil {
		t.Fatalf("domain pools %v, want %v: %v", got, want, err)
	}
}

func indexedJob(ns, name string, n int32, template, domainClaimName string) *batchv1.Job {
	pod := memberPod(ns, "", name, template, domainClaimName)
	return &batchv1.Job{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: batchv1.JobSpec{
			Completions: ptr.To(n), Parallelism: ptr.To(n),
			CompletionMode:   ptr.To(batchv1.IndexedCompletion),
			PodFailurePolicy: podFailurePolicy,
			Template: corev1.PodTemplateSpec{
				Spec: func() corev1.PodSpec {
					s := pod.Spec
					s.RestartPolicy = corev1.RestartPolicyNever
					return s
				}(),
			},
		},
	}
}

// deleteJob deletes a Job and its pods and waits until they are gone.
func (c *tesseraCluster) deleteJob(ctx context.Context, t testing.TB, ns, name string) {
	t.Helper()
	err := c.Client().BatchV1().Jobs(ns).Delete(ctx, name, metav1.DeleteOptions{PropagationPolicy: ptr.To(metav1.DeletePropagationBackground)})
	if err != nil {
		t.Errorf("delete job %s/%s: %v", ns, name, err)
		return
	}
	err = wait.PollUntilContextTimeout(ctx, 300*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		pods, err := c.Client().CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: jobName + "=" + name})
		return err == nil && len(pods.Items) == 0, nil
	})
	if err != nil {
		t.Errorf("pods of job %s/%s not gone: %v", ns, name, err)
	}
}

// deleteGangAndMembers deletes a label gang, its pods, and waits.
func (c *tesseraCluster) deleteGangAndMembers(ctx context.Context, t *testing.T, gs gangs, ns, name string) {
	t.Helper()
	gs.delete(ctx, t, ns, name)
	c.deleteGangPods(ctx, t, ns, name)
}

// deleteGangPods deletes the pods of label gangs and waits until they are
// gone.
func (c *tesseraCluster) deleteGangPods(ctx context.Context, t *testing.T, ns string, names ...string) {
	t.Helper()
	var pods []*corev1.Pod
	for _, name := range names {
		ps := c.gangPods(ctx, t, ns, name)
		for i := range ps {
			pods = append(pods, &ps[i])
		}
	}
	c.deletePodsAndWait(ctx, t, pods...)
}

func (c *tesseraCluster) hasEvent(ctx context.Context, ns, object, reason string) bool {
	return c.hasEventOf(ctx, ns, gangv1.Kind, object, reason)
}

// hasEventOf says whether the object of this kind has an event of reason.
func (c *tesseraCluster) hasEventOf(ctx context.Context, ns, kind, object, reason string) bool {
	list, err := c.Client().CoreV1().Events(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return false
	}
	for _, e := range list.Items {
		if e.InvolvedObject.Name == object && e.InvolvedObject.Kind == kind && e.Reason == reason {
			return true
		}
	}
	return false
}

func getClaim(ctx context.Context, t testing.TB, c *tesseraCluster, ns, name string) *resourceapi.ResourceClaim {
	t.Helper()
	claim, err := c.Client().ResourceV1().ResourceClaims(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("get claim %s/%s: %v", ns, name, err)
	}
	return claim
}

// ok drops a call's value, keeping its error.
func ok[T any](_ T, err error) error { return err }

func noErr(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func conditionReason(g *gangv1.Gang, typ string) string {
	for _, c := range g.Status.Conditions {
		if c.Type == typ && c.Status == metav1.ConditionTrue {
			return c.Reason
		}
	}
	return ""
}

func conditionStatus(g *gangv1.Gang, typ string) bool {
	return conditionReason(g, typ) != ""
}

func conditionMessageOf(g *gangv1.Gang, typ string) string {
	for _, c := range g.Status.Conditions {
		if c.Type == typ {
			return c.Message
		}
	}
	return ""
}
