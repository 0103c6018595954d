package devicemeta

import (
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/discovery"
	"github.com/tessera-dev/tessera/driver/inventory"
)

// TestASharedGPUsMetadataSaysWhatTheClaimWasGranted: on a memory-shared
// GPU the claim's memory is what it was granted, not the GPU's, and the
// settings it asked for are there; published attributes come along.
func TestASharedGPUsMetadataSaysWhatTheClaimWasGranted(t *testing.T) {
	g := discovery.GPU{Index: 1, UUID: "GPU-1111", ProductName: "NVIDIA L4", MemoryBytes: 24 << 30, PCIBusID: "0000:41:00.0"}
	inv := inventory.Build([]discovery.GPU{g}, inventory.Options{Sharing: func(discovery.GPU) inventory.Share { return inventory.Share{Memory: true} }})
	claim := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "c"}}
	prepared := []checkpoint.Device{{Pool: "node", Device: "gpu-1", MemoryBytes: 4 << 30, ShareID: "s", Settings: &checkpoint.Settings{ComputeMode: "Default", PowerLimitMW: 60500}}}
	devs, err := Describe(inv, claim, prepared, []kubeletplugin.Device{{Requests: []string{"gpu"}, PoolName: "node", DeviceName: "gpu-1"}})
	if err != nil {
		t.Fatal(err)
	}
	a := devs[0].Metadata.Attributes
	check := func(key string, want any) {
		t.Helper()
		v, ok := a[key]
		switch {
		case !ok:
			t.Errorf("no attribute %s in %v", key, a)
		case v.IntValue != nil && *v.IntValue != want:
			t.Errorf("%s = %d, want %v", key, *v.IntValue, want)
		case v.StringValue != nil && *v.StringValue != want:
			t.Errorf("%s = %q, want %v", key, *v.StringValue, want)
		}
	}
	check(AttrMemoryBytes, int64(4<<30))
	check(AttrPowerLimitWatts, int64(60))
	check(AttrComputeMode, "Default")
	check("uuid", "GPU-1111")
	check("productName", "NVIDIA L4")
	if v, ok := a["memoryShared"]; !ok || v.BoolValue == nil || !*v.BoolValue {
		t.Errorf("memoryShared = %+v, want true", v)
	}
	for _, k := range []string{AttrGang, AttrGangRank, AttrRole} {
		if _, ok := a[k]; ok {
			t.Errorf("a claim of no gang has %s", k)
		}
	}
}

// TestAMemberWhoseAnnotationsDoNotParseFailsItsPrepare: the gang
// controller's annotations are read as the environment reads them.
func TestAMemberWhoseAnnotationsDoNotParseFailsItsPrepare(t *testing.T) {
	inv := inventory.Build([]discovery.GPU{{Index: 0, UUID: "GPU-0"}}, inventory.Options{})
	claim := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "c", Annotations: map[string]string{
		gangv1.AnnotationGang: "ns/g", gangv1.AnnotationSize: "2", gangv1.AnnotationRank: "first",
	}}}
	_, err := Describe(inv, claim, nil, []kubeletplugin.Device{{PoolName: "node", DeviceName: "gpu-0"}})
	if err == nil || !strings.Contains(err.Error(), gangv1.AnnotationRank) {
		t.Errorf("err = %v, want one naming %s", err, gangv1.AnnotationRank)
	}
}
