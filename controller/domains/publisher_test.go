package domains

import (
	"errors"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/ptr"

	"github.com/tessera-dev/tessera/driver/domain"
)

// TestAdoptGivesEveryDomainSliceItsOwner: the domain slices an earlier
// version published without an owner, and those owned by a replaced
// DeviceClass of the same name, get the current class as their only owner
// of that name (others' references kept, and the class is not made the
// controller of a slice that has one); a slice already owned is not
// written; node slices and other drivers' slices are not touched. A
// conflicting write is retried on the slice as it is now, and a slice the
// API server refuses to change is left without stopping the others.
func TestAdoptGivesEveryDomainSliceItsOwner(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	owner := resourceslice.Owner{APIVersion: "resource.k8s.io/v1", Kind: "DeviceClass", Name: "domain.gpu.tessera.dev", UID: "class-uid"}
	ref := func(o resourceslice.Owner) metav1.OwnerReference {
		return metav1.OwnerReference{APIVersion: o.APIVersion, Kind: o.Kind, Name: o.Name, UID: o.UID, Controller: ptr.To(true)}
	}
	stale := owner
	stale.UID = "replaced-class-uid"
	other := metav1.OwnerReference{APIVersion: "v1", Kind: "ConfigMap", Name: "x", UID: "cm-uid"}
	otherController := metav1.OwnerReference{APIVersion: "v1", Kind: "ConfigMap", Name: "y", UID: "cm-y-uid", Controller: ptr.To(true)}
	pool := domain.PoolName(domain.KindNVLink, "u.1")
	slice := func(name, drv, pool string, nodeName *string, refs ...metav1.OwnerReference) *resourceapi.ResourceSlice {
		return &resourceapi.ResourceSlice{
			ObjectMeta: metav1.ObjectMeta{Name: name, OwnerReferences: refs, ResourceVersion: "1"},
			Spec:       resourceapi.ResourceSliceSpec{Driver: drv, NodeName: nodeName, Pool: resourceapi.ResourcePool{Name: pool}},
		}
	}
	client := fake.NewClientset(
		slice("unowned", driver, pool, nil),
		slice("stale", driver, pool, nil, ref(stale), other),
		slice("owned", driver, pool, nil, ref(owner)),
		slice("node", driver, "a", ptr.To("a")),
		slice("foreign", "nic.example.com", pool, nil),
		slice("controlled", driver, pool, nil, otherController),
		slice("conflicted", driver, pool, nil),
		slice("refused", driver, pool, nil),
	)
	conflicts := 0
	client.PrependReactor("update", "resourceslices", func(a k8stesting.Action) (bool, runtime.Object, error) {
		switch a.(k8stesting.UpdateAction).GetObject().(*resourceapi.ResourceSlice).Name {
		case "conflicted":
			if conflicts++; conflicts == 1 {
				return true, nil, apierrors.NewConflict(resourceapi.Resource("resourceslices"), "conflicted", errors.New("changed meanwhile"))
			}
		case "refused":
			return true, nil, apierrors.NewInvalid(resourceapi.SchemeGroupVersion.WithKind("ResourceSlice").GroupKind(), "refused", nil)
		}
		return false, nil, nil
	})
	if err := adopt(ctx, client, driver, owner); err != nil {
		t.Fatal(err)
	}
	notController := ref(owner)
	notController.Controller = ptr.To(false)
	want := map[string][]metav1.OwnerReference{
		"unowned":    {ref(owner)},
		"stale":      {other, ref(owner)},
		"owned":      {ref(owner)},
		"node":       nil,
		"foreign":    nil,
		"controlled": {otherController, notController},
		"conflicted": {ref(owner)},
		"refused":    nil,
	}
	for name, refs := range want {
		s, err := client.ResourceV1().ResourceSlices().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if len(s.OwnerReferences) != len(refs) {
			t.Errorf("slice %s: owners %+v, want %+v", name, s.OwnerReferences, refs)
			continue
		}
		for i := range refs {
			got := s.OwnerReferences[i]
			if got.UID != refs[i].UID || got.Kind != refs[i].Kind || ptr.Deref(got.Controller, false) != ptr.Deref(refs[i].Controller, false) {
				t.Errorf("slice %s: owners %+v, want %+v", name, s.OwnerReferences, refs)
			}
		}
	}
	for _, a := range client.Actions() {
		if u, ok := a.(interface{ GetObject() runtime.Object }); ok && a.GetVerb() == "update" {
			if name := u.GetObject().(*resourceapi.ResourceSlice).Name; name == "owned" || name == "node" || name == "foreign" {
				t.Errorf("adopt wrote slice %s", name)
			}
		}
	}
}
