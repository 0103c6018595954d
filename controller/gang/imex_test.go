package gang

import (
	"fmt"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/driver/daemonpod"
	"github.com/tessera-dev/tessera/driver/imex"
)

// A gang placed across two trays of one clique: its domain claim lists
// both nodes with their InternalIPs, which the nodes' IMEX daemons are
// configured with, and the gang's IMEXReady condition follows the daemon
// pods the plugins run for the claim (labelled with its UID).
func TestTheDomainClaimListsThePlacementsNodesAndTheGangItsIMEXDaemons(t *testing.T) {
	snap, nodes := trays(t, map[string]uint32{"a1": 1, "a2": 1})
	nodes["a1"].Status.Addresses = []v1.NodeAddress{{Type: v1.NodeHostName, Address: "a1"}, {Type: v1.NodeInternalIP, Address: "10.0.0.1"}}
	nodes["a2"].Status.Addresses = []v1.NodeAddress{{Type: v1.NodeInternalIP, Address: "10.0.0.2"}, {Type: v1.NodeInternalIP, Address: "10.9.9.9"}}
	f := newFakeCluster(t, snap, nodes)
	f.r.imex = true
	f.r.imexNamespace = "tessera-system"
	f.create(newClaim("domain", "domain.gpu.tessera.dev", 1))
	for _, name := range []string{"m-0", "m-1"} {
		f.member(name, map[string]string{"gang": "g"}, 4) // a whole tray each
	}
	if _, err := f.r.gangs.Create(f.ctx, labelGangOf("g", 2, "domain")); err != nil {
		t.Fatal(err)
	}
	if _, err := f.reconcile("ml", "g"); err != nil {
		t.Fatal(err)
	}
	domain := f.claim("ml", "domain")
	if got := domain.Annotations[gangv1.AnnotationNodes]; got != "a1=10.0.0.1,a2=10.0.0.2" {
		t.Fatalf("domain claim's nodes %q, want both trays with their first InternalIP", got)
	}
	for _, name := range []string{"m-0", "m-1"} {
		p := f.pod("ml", name)
		p.Spec.NodeName = pinnedTo(p)
		p.Status.Phase = v1.PodRunning
		if err := f.client.Tracker().Update(v1.SchemeGroupVersion.WithResource("pods"), p, "ml"); err != nil {
			t.Fatal(err)
		}
	}
	imexReady := func() *metav1.Condition {
		t.Helper()
		if _, err := f.reconcile("ml", "g"); err != nil {
			t.Fatal(err)
		}
		return meta.FindStatusCondition(f.gang("ml", "g").Status.Conditions, gangv1.ConditionIMEXReady)
	}
	if c := imexReady(); c == nil || c.Status != metav1.ConditionFalse || !strings.Contains(c.Message, "a1 (no daemon), a2 (no daemon)") {
		t.Fatalf("IMEXReady before any daemon: %+v, want false naming both nodes", c)
	}
	daemon := func(ns, node, addresses string, ready v1.ConditionStatus) {
		p := &v1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: "tessera-imex-" + string(domain.UID) + "-" + node, Namespace: ns,
				Labels:      map[string]string{daemonpod.LabelApp: imex.AppName, daemonpod.LabelNode: node, daemonpod.LabelClaimUID: string(domain.UID)},
				Annotations: map[string]string{daemonpod.AnnotationClaim: "ml/domain", imex.AnnotationNodes: addresses}},
			Spec:   v1.PodSpec{NodeName: node},
			Status: v1.PodStatus{Conditions: []v1.PodCondition{{Type: v1.PodReady, Status: ready}}},
		}
		if err := f.client.Tracker().Add(p); err != nil {
			if err := f.client.Tracker().Update(v1.SchemeGroupVersion.WithResource("pods"), p, p.Namespace); err != nil {
				t.Fatal(err)
			}
		}
	}
	const both = "10.0.0.1,10.0.0.2"
	daemon("tessera-system", "a1", both, v1.ConditionTrue)
	daemon("ml", "a2", both, v1.ConditionTrue) // a look-alike in a user's namespace
	if c := imexReady(); c == nil || c.Status != metav1.ConditionFalse || !strings.Contains(c.Message, "ready on 1 of 2 nodes; not on a2 (no daemon)") {
		t.Fatalf("IMEXReady with a look-alike daemon for a2 in the gang's namespace: %+v", c)
	}
	daemon("tessera-system", "a2", "10.0.0.2,10.0.0.3", v1.ConditionTrue)
	if c := imexReady(); c == nil || c.Status != metav1.ConditionFalse || !strings.Contains(c.Message, "configured for 10.0.0.2,10.0.0.3") {
		t.Fatalf("IMEXReady with a2's daemon configured for other nodes: %+v", c)
	}
	daemon("tessera-system", "a2", both, v1.ConditionFalse)
	if c := imexReady(); c == nil || c.Status != metav1.ConditionFalse || !strings.Contains(c.Message, "ready on 1 of 2 nodes; not on a2 (daemon tessera-system/") {
		t.Fatalf("IMEXReady with a2's daemon not ready: %+v", c)
	}
	daemon("tessera-system", "a2", both, v1.ConditionTrue)
	if c := imexReady(); c == nil || c.Status != metav1.ConditionTrue || c.Reason != gangv1.ReasonIMEXReady {
		t.Fatalf("IMEXReady with both daemons ready: %+v, want true", c)
	}
}

// A node serves one IMEX domain at a time: a second gang on an NVLink
// domain is placed on a node no other gang's IMEX daemon serves, although
// packing would put it beside the first.
func TestASecondNVLinkGangAvoidsTheFirstGangsIMEXNodes(t *testing.T) {
	snap, nodes := trays(t, map[string]uint32{"a1": 1, "a2": 1})
	withAddresses(nodes)
	f := newFakeCluster(t, snap, nodes)
	f.r.imex = true
	f.gangMembers(1)
	if _, err := f.reconcile("ml", "g"); err != nil {
		t.Fatal(err)
	}
	first := pinnedTo(f.pod("ml", "m-0"))
	if first == "" {
		t.Fatal("the first gang was not placed")
	}
	f.create(newClaim("domain-h", "domain.gpu.tessera.dev", 1))
	f.member("h-0", map[string]string{"gang": "h"}, 1)
	h := f.pod("ml", "h-0")
	h.Spec.ResourceClaims[1].ResourceClaimName = ptr.To("domain-h")
	if err := f.client.Tracker().Update(v1.SchemeGroupVersion.WithResource("pods"), h, "ml"); err != nil {
		t.Fatal(err)
	}
	if _, err := f.r.gangs.Create(f.ctx, labelGangOf("h", 1, "domain-h")); err != nil {
		t.Fatal(err)
	}
	if _, err := f.reconcile("ml", "h"); err != nil {
		t.Fatal(err)
	}
	if second := pinnedTo(f.pod("ml", "h-0")); second == "" || second == first {
		t.Errorf("second gang placed on %q, first on %q; want the other tray", second, first)
	}
}

// withAddresses gives every node an InternalIP.
func withAddresses(nodes map[string]*v1.Node) {
	i := 0
	for _, n := range nodes {
		i++
		n.Status.Addresses = []v1.NodeAddress{{Type: v1.NodeInternalIP, Address: fmt.Sprintf("10.0.1.%d", i)}}
	}
}

// A node without an InternalIP has no address for an IMEX daemon to serve
// on: an NVLink gang is placed beside it, and waits, saying why, when no
// node has one.
func TestAnNVLinkGangAvoidsNodesWithoutAnAddress(t *testing.T) {
	snap, nodes := trays(t, map[string]uint32{"a1": 1, "a2": 1})
	nodes["a2"].Status.Addresses = []v1.NodeAddress{{Type: v1.NodeInternalIP, Address: "10.0.0.2"}}
	f := newFakeCluster(t, snap, nodes)
	f.r.imex = true
	f.gangMembers(1)
	if _, err := f.reconcile("ml", "g"); err != nil {
		t.Fatal(err)
	}
	if got := pinnedTo(f.pod("ml", "m-0")); got != "a2" {
		t.Errorf("gang placed on %q, want a2, the tray with an address", got)
	}

	snap, nodes = trays(t, map[string]uint32{"b1": 1})
	f = newFakeCluster(t, snap, nodes)
	f.r.imex = true
	f.gangMembers(1)
	if _, err := f.reconcile("ml", "g"); err != nil {
		t.Fatal(err)
	}
	c := meta.FindStatusCondition(f.gang("ml", "g").Status.Conditions, gangv1.ConditionWaiting)
	if c == nil || c.Reason != gangv1.ReasonNoDomainFits || !strings.Contains(c.Message, "has an InternalIP") {
		t.Errorf("gang on a clique without addresses: %+v, want it waiting, saying why", c)
	}
}
