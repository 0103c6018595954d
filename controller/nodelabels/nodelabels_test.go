package nodelabels

import (
	"context"
	"maps"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/utils/ptr"
)

const driver = "gpu.tessera.dev"

// slice is a node's slice of GPUs, each with the clique and domain given
// ("" leaves the attribute out).
func slice(name, node string, generation int64, cliques ...string) *resourceapi.ResourceSlice {
	s := &resourceapi.ResourceSlice{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: resourceapi.ResourceSliceSpec{
		Driver: driver, NodeName: ptr.To(node), Pool: resourceapi.ResourcePool{Name: node, Generation: generation, ResourceSliceCount: 1},
	}}
	for i, c := range cliques {
		d := resourceapi.Device{Name: "gpu-" + string(rune('0'+i)), Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{}}
		// nvlinkDomain, the GPUs joined inside one node, is no label.
		d.Attributes["nvlinkDomain"] = resourceapi.DeviceAttribute{StringValue: ptr.To("GPU-" + node + "-island")}
		if c != "" {
			d.Attributes["nvlinkClique"] = resourceapi.DeviceAttribute{StringValue: ptr.To(c)}
		}
		s.Spec.Devices = append(s.Spec.Devices, d)
	}
	return s
}

func TestWantLabelsANodeOnlyWithWhatAllItsGPUsAgreeOn(t *testing.T) {
	const a, b = "3e9a61c2-5b7d-4f10-8c2e-6d4b1a7f9e03.1", "3e9a61c2-5b7d-4f10-8c2e-6d4b1a7f9e03.2"
	domain := a[:len(a)-2]
	other := slice("other", "tray-x", 0, a)
	other.Spec.Driver = "nic.example.com"
	got := Want([]*resourceapi.ResourceSlice{
		slice("t1", "tray-1", 0, a, a, a, a),
		slice("t2", "tray-2", 0, b, b, "", b), // a GPU without the attribute does not count
		slice("mixed", "mixed", 0, a, b),      // two cliques: no clique label, one domain
		slice("old", "moved", 1, a),           // an older generation of the pool
		slice("new", "moved", 2, b),           // ... is not read
		slice("none", "pcie", 0, "", ""),      // no NVLink: no label
		other,                                 // another driver's slice
		{Spec: resourceapi.ResourceSliceSpec{Driver: driver, Pool: resourceapi.ResourcePool{Name: "domains/x"}}}, // no node
	}, driver)
	want := map[string]map[string]string{
		"tray-1": {LabelClique: a, LabelDomain: domain},
		"tray-2": {LabelClique: b, LabelDomain: domain},
		"mixed":  {LabelDomain: domain},
		"moved":  {LabelClique: b, LabelDomain: domain},
	}
	if !maps.EqualFunc(got, want, maps.Equal) {
		t.Errorf("Want = %v\nwant %v", got, want)
	}
}

func TestWantRefusesAValueThatIsNoLabelValue(t *testing.T) {
	long := strings.Repeat("a", 70)
	got := Want([]*resourceapi.ResourceSlice{slice("t", "tray", 0, long+".1"), slice("u", "bad", 0, "a b.1")}, driver)
	if len(got) != 0 {
		t.Errorf("Want = %v, want no label for a value over 63 characters or with a space", got)
	}
	// A clique with no "." has no domain part.
	got = Want([]*resourceapi.ResourceSlice{slice("t", "tray", 0, "clique")}, driver)
	if want := map[string]map[string]string{"tray": {LabelClique: "clique"}}; !maps.EqualFunc(got, want, maps.Equal) {
		t.Errorf("Want = %v, want %v", got, want)
	}
}

func TestPatchChangesOnlyItsOwnLabels(t *testing.T) {
	n := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n", Labels: map[string]string{"team": "ml", LabelClique: "old.1", LabelDomain: "d"}}}
	if p := string(Patch(n, map[string]string{LabelClique: "new.1", LabelDomain: "d"})); p != `{"metadata":{"labels":{"gpu.tessera.dev/nvlink-clique":"new.1"}}}` {
		t.Errorf("patch = %s", p)
	}
	if p := string(Patch(n, nil)); p != `{"metadata":{"labels":{"gpu.tessera.dev/nvlink-clique":null,"gpu.tessera.dev/nvlink-domain":null}}}` {
		t.Errorf("patch removing both = %s", p)
	}
	if p := Patch(n, map[string]string{LabelClique: "old.1", LabelDomain: "d"}); p != nil {
		t.Errorf("patch of a node already labelled = %s, want none", p)
	}
}

// TestStartLabelsNodesAsTheirSlicesChange runs the labeller on a fake API
// server: a tray is labelled, relabelled when its slice moves to another
// clique, and unlabelled when its slice goes; another label stays.
func TestStartLabelsNodesAsTheirSlicesChange(t *testing.T) {
	const a, b = "dom.1", "dom.2"
	client := fake.NewClientset(&v1.Node{ObjectMeta: metav1.ObjectMeta{Name: "tray", Labels: map[string]string{"team": "ml"}}})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	factory := informers.NewSharedInformerFactory(client, 0)
	if err := Start(ctx, client, factory, Options{Driver: driver, Retry: 10 * time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	factory.Start(ctx.Done())
	await := func(what string, want map[string]string) {
		t.Helper()
		err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 10*time.Second, true, func(ctx context.Context) (bool, error) {
			n, err := client.CoreV1().Nodes().Get(ctx, "tray", metav1.GetOptions{})
			return err == nil && maps.Equal(n.Labels, want), err
		})
		if err != nil {
			n, _ := client.CoreV1().Nodes().Get(ctx, "tray", metav1.GetOptions{})
			t.Fatalf("%s: node labels %v, want %v", what, n.Labels, want)
		}
	}
	s, err := client.ResourceV1().ResourceSlices().Create(ctx, slice("tray", "tray", 0, a, a), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	await("published in clique a", map[string]string{"team": "ml", LabelClique: a, LabelDomain: "dom"})
	s.Spec.Devices = slice("tray", "tray", 0, b, b).Spec.Devices
	if _, err := client.ResourceV1().ResourceSlices().Update(ctx, s, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	await("moved to clique b", map[string]string{"team": "ml", LabelClique: b, LabelDomain: "dom"})
	if err := client.ResourceV1().ResourceSlices().Delete(ctx, "tray", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	await("slice gone", map[string]string{"team": "ml"})
}
