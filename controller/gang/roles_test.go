package gang

import (
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
)

// rolesGang creates gang ml/g of a launcher (launcherGPUs, possibly none)
// and workers of workerGPUs each, the workers numbered by indexed-Job
// completion index in the reverse of their names' order.
func (f *fakeCluster) rolesGang(launcherGPUs int64, workers int, workerGPUs int64) {
	f.t.Helper()
	f.create(newClaim("domain", "domain.gpu.tessera.dev", 1))
	f.member("launcher", map[string]string{"gang": "g", "role": "launcher"}, launcherGPUs)
	for i := range workers {
		name := "w-" + string(rune('a'+i))
		f.member(name, map[string]string{"gang": "g", "role": "worker", jobIndexLabel: string(rune('0' + workers - 1 - i))}, workerGPUs)
	}
	g := labelGangOf("g", int32(1+workers), "domain")
	g.Spec.Roles = []gangv1.Role{
		{Name: "launcher", Size: 1, Selector: metav1.LabelSelector{MatchLabels: map[string]string{"role": "launcher"}}},
		{Name: "workers", Size: int32(workers), Selector: metav1.LabelSelector{MatchLabels: map[string]string{"role": "worker"}}},
	}
	if _, err := f.r.gangs.Create(f.ctx, g); err != nil {
		f.t.Fatal(err)
	}
}

// A launcher and its workers are placed together, all or nothing, in one
// domain; each member's claims and pod carry its rank in the gang (the
// launcher first) and its role, rank within the role and role size, which
// the kubelet plugin turns into TESSERA_GANG_ROLE* env.
func TestARoleGangIsPlacedInOneDomainWithRanksPerRole(t *testing.T) {
	snap, nodes := trays(t, map[string]uint32{"a1": 1, "b1": 2, "b2": 2, "b3": 2})
	f := newFakeCluster(t, snap, nodes)
	// 1 + 2x4 GPUs: more than the one-tray clique has.
	f.rolesGang(1, 2, 4)
	if _, err := f.reconcile("ml", "g"); err != nil {
		t.Fatal(err)
	}
	if c := meta.FindStatusCondition(f.gang("ml", "g").Status.Conditions, gangv1.ConditionPlaced); c == nil || c.Status != metav1.ConditionTrue {
		t.Fatalf("Placed condition %+v, want True", c)
	}
	want := map[string]map[string]string{
		"launcher": {gangv1.AnnotationRank: "0", gangv1.AnnotationRole: "launcher", gangv1.AnnotationRoleRank: "0", gangv1.AnnotationRoleSize: "1"},
		"w-b":      {gangv1.AnnotationRank: "1", gangv1.AnnotationRole: "workers", gangv1.AnnotationRoleRank: "0", gangv1.AnnotationRoleSize: "2"},
		"w-a":      {gangv1.AnnotationRank: "2", gangv1.AnnotationRole: "workers", gangv1.AnnotationRoleRank: "1", gangv1.AnnotationRoleSize: "2"},
	}
	for name, annotations := range want {
		c := f.claim("ml", name+"-gpu")
		p := f.pod("ml", name)
		for k, v := range annotations {
			if c.Annotations[k] != v || p.Annotations[k] != v {
				t.Errorf("member %s: %s is %q on its claim and %q on its pod, want %q", name, k, c.Annotations[k], p.Annotations[k], v)
			}
		}
		if c.Status.Allocation != nil {
			t.Fatalf("member %s: the controller allocated its claim; only the scheduler may", name)
		}
		if node := pinnedTo(p); node == "a1" || node == "" || c.Annotations[gangv1.AnnotationNode] != node {
			t.Errorf("member %s pinned to %q (its claim says %q), want a tray of the three-tray clique", name, node, c.Annotations[gangv1.AnnotationNode])
		}
	}
	if r := f.claim("ml", "domain").Status.Allocation.Devices.Results[0]; r.Pool != poolOf(2) {
		t.Errorf("domain claim allocated in %s, want %s", r.Pool, poolOf(2))
	}
}

// A role short of members holds the whole gang, naming the role; a member
// of no role makes the gang invalid, naming the member.
func TestARoleGangWaitsForEveryRole(t *testing.T) {
	snap, nodes := trays(t, map[string]uint32{"b1": 2, "b2": 2, "b3": 2})
	f := newFakeCluster(t, snap, nodes)
	f.rolesGang(0, 2, 4)
	if err := f.client.Tracker().Delete(v1.SchemeGroupVersion.WithResource("pods"), "ml", "w-a"); err != nil {
		t.Fatal(err)
	}
	f.member("stray", map[string]string{"gang": "g"}, 1) // in the gang's selector, in no role
	if _, err := f.reconcile("ml", "g"); err != nil {
		t.Fatal(err)
	}
	c := meta.FindStatusCondition(f.gang("ml", "g").Status.Conditions, gangv1.ConditionWaiting)
	if c == nil || c.Reason != gangv1.ReasonInvalid || !strings.Contains(c.Message, "member ml/stray matches no role's selector") {
		t.Errorf("Waiting condition %+v, want InvalidGang naming ml/stray", c)
	}
	if err := f.client.Tracker().Delete(v1.SchemeGroupVersion.WithResource("pods"), "ml", "stray"); err != nil {
		t.Fatal(err)
	}
	if _, err := f.reconcile("ml", "g"); err != nil {
		t.Fatal(err)
	}
	c = meta.FindStatusCondition(f.gang("ml", "g").Status.Conditions, gangv1.ConditionWaiting)
	if c == nil || c.Reason != gangv1.ReasonMembersMissing || !strings.Contains(c.Message, "role workers: 1 of 2 members exist") {
		t.Errorf("Waiting condition %+v, want MembersMissing naming role workers", c)
	}
	for _, name := range []string{"launcher", "w-b"} {
		if p := f.pod("ml", name); !hasGate(p) {
			t.Errorf("member %s released while a role is short", name)
		}
	}
	if a := f.claim("ml", "w-b-gpu").Status.Allocation; a != nil {
		t.Errorf("a worker's claim was allocated while a role is short: %+v", a.Devices.Results)
	}
}

// When a member is lost, the others are evicted in the reverse of the
// roles' order: every worker before the launcher. A launcher without
// claims of its own is released unpinned, and still carries its role.
func TestALostRoleGangEvictsWorkersBeforeTheLauncher(t *testing.T) {
	snap, nodes := trays(t, map[string]uint32{"b1": 2, "b2": 2, "b3": 2})
	f := newFakeCluster(t, snap, nodes)
	f.rolesGang(0, 4, 2)
	if _, err := f.reconcile("ml", "g"); err != nil {
		t.Fatal(err)
	}
	launcher := f.pod("ml", "launcher")
	if hasGate(launcher) || pinnedTo(launcher) != "" || launcher.Annotations[gangv1.AnnotationRole] != "launcher" || launcher.Annotations[gangv1.AnnotationRank] != "0" {
		t.Fatalf("launcher: gated %v, pinned to %q, annotations %v; want it released unpinned as rank 0 of role launcher", hasGate(launcher), pinnedTo(launcher), launcher.Annotations)
	}
	for _, name := range []string{"launcher", "w-a", "w-b", "w-c", "w-d"} {
		p := f.pod("ml", name)
		p.Spec.NodeName = pinnedTo(p)
		if p.Spec.NodeName == "" {
			p.Spec.NodeName = "b1"
		}
		p.Status.Phase = v1.PodRunning
		if name == "w-c" {
			p.Status.Phase = v1.PodFailed
		}
		if err := f.client.Tracker().Update(v1.SchemeGroupVersion.WithResource("pods"), p, "ml"); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := f.reconcile("ml", "g"); err != nil {
		t.Fatal(err)
	}
	if len(f.evicted) != 4 || f.evicted[3] != "launcher" {
		t.Errorf("evicted %v, want the three other workers, then the launcher", f.evicted)
	}
}
