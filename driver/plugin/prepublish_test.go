package plugin_test

import (
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	k8stesting "k8s.io/client-go/testing"
)

// TestFreshNodeSlicesArePublishedDirectlyAndAdopted: on a node without
// slices the plugin creates them before the ResourceSlice controller has
// even started watching, and the controller adopts them: a later change
// (a taint) updates those slices in place, with no slice created twice or
// deleted.
func TestFreshNodeSlicesArePublishedDirectlyAndAdopted(t *testing.T) {
	h := startHealth(t, "pcie-l4x4")
	first := h.awaitSlices("the four L4s", func(m map[string][]string) bool { return len(m) == 4 })
	names := map[string]bool{}
	for _, s := range first {
		names[s.Name] = true
	}
	if err := h.node.InjectXID(1, 48); err != nil {
		t.Fatal(err)
	}
	after := h.awaitSlices("taint on gpu-1", func(m map[string][]string) bool { return len(m["gpu-1"]) > 0 })
	for _, s := range after {
		if !names[s.Name] {
			t.Errorf("slice %s is not one the plugin published first (%v): the controller replaced them", s.Name, names)
		}
	}
	creates, updates, watchedAt := 0, 0, -1
	for i, a := range h.client.Actions() {
		if a.GetResource().Resource != "resourceslices" {
			continue
		}
		switch a.GetVerb() {
		case "create":
			creates++
			if watchedAt >= 0 {
				t.Errorf("slice %s was created after the controller started watching", a.(k8stesting.CreateAction).GetObject().(*resourceapi.ResourceSlice).GenerateName)
			}
		case "update":
			updates++
		case "delete", "delete-collection":
			t.Errorf("a slice was deleted: %v", a)
		case "watch":
			if watchedAt < 0 {
				watchedAt = i
			}
		}
	}
	if creates != len(first) || updates == 0 || watchedAt < 0 {
		t.Errorf("%d creates for %d slices, %d updates, controller watching: %v; want every slice created once, before the controller watched, then updated", creates, len(first), updates, watchedAt >= 0)
	}
}
