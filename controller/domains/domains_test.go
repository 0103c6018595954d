package domains

import (
	"reflect"
	"testing"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/tessera-dev/tessera/driver/domain"
)

const driver = "gpu.tessera.dev"

func node(name, rack string) *v1.Node {
	return &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"rack": rack, "kubernetes.io/hostname": name}}}
}

func gpuSlice(nodeName, clique string, gpus int) *resourceapi.ResourceSlice {
	s := &resourceapi.ResourceSlice{Spec: resourceapi.ResourceSliceSpec{Driver: driver, NodeName: ptr.To(nodeName), Pool: resourceapi.ResourcePool{Name: nodeName}}}
	for i := range gpus {
		attrs := map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{"type": {StringValue: ptr.To("gpu")}}
		if clique != "" {
			attrs["nvlinkClique"] = resourceapi.DeviceAttribute{StringValue: ptr.To(clique)}
		}
		s.Spec.Devices = append(s.Spec.Devices, resourceapi.Device{Name: "gpu-" + string(rune('0'+i)), Attributes: attrs})
	}
	return s
}

func TestDomainsFollowNodesAndSlices(t *testing.T) {
	nodes := []*v1.Node{node("a", "r1"), node("b", "r1"), node("c", "r2"), node("idle", "r2")}
	sl := []*resourceapi.ResourceSlice{gpuSlice("a", "u.1", 4), gpuSlice("b", "u.1", 4), gpuSlice("c", "", 8), gpuSlice("gone", "u.1", 4)}
	got := Compute(nodes, sl, driver, "rack")
	want := []Domain{
		{Kind: domain.KindNVLink, Value: "u.1", Nodes: []string{"a", "b"}, Hosts: []string{"a", "b"}, GPUs: 8},
		{Kind: domain.KindTopology, Value: "r1", Nodes: []string{"a", "b"}, Hosts: []string{"a", "b"}, GPUs: 8},
		{Kind: domain.KindTopology, Value: "r2", Nodes: []string{"c"}, Hosts: []string{"c"}, GPUs: 8},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Compute:\n got %+v\nwant %+v", got, want)
	}
	// Node b leaves: both of its domains shrink.
	nodes[1].DeletionTimestamp = &metav1.Time{}
	got = Compute(nodes, sl, driver, "rack")
	if len(got) != 3 || !reflect.DeepEqual(got[0].Nodes, []string{"a"}) || !reflect.DeepEqual(got[1].Nodes, []string{"a"}) {
		t.Errorf("after node b left: %+v", got)
	}
	res := Resources(got, 2)
	p := res.Pools[domain.PoolName(domain.KindNVLink, "u.1")]
	if !reflect.DeepEqual(HostsOf(p.NodeSelector), []string{"a"}) || len(p.Slices) != 1 || len(p.Slices[0].Devices) != 2 {
		t.Errorf("pool of u.1: selector %+v, slices %+v", p.NodeSelector, p.Slices)
	}
}
