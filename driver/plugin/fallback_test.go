package plugin_test

import (
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/tessera-dev/tessera/driver/nodeopen"
	"github.com/tessera-dev/tessera/driver/plugin"
)

// withoutPartitionableDevices makes the fake API server drop the fields of
// partitionable devices, as one with DRAPartitionableDevices off does.
func withoutPartitionableDevices(c *fake.Clientset) {
	dropFromSlices(c, func(s *resourceapi.ResourceSlice) {
		s.Spec.SharedCounters = nil
		for i := range s.Spec.Devices {
			s.Spec.Devices[i].ConsumesCounters = nil
		}
	})
}

// dropFromSlices makes the fake API server change every ResourceSlice it
// stores as drop says, as one with a feature off strips that feature's
// fields.
func dropFromSlices(c *fake.Clientset, drop func(*resourceapi.ResourceSlice)) {
	strip := func(action k8stesting.Action) (bool, runtime.Object, error) {
		// Create and update actions both carry the object.
		if a, ok := action.(interface{ GetObject() runtime.Object }); ok {
			if s, ok := a.GetObject().(*resourceapi.ResourceSlice); ok {
				drop(s)
			}
		}
		return false, nil, nil
	}
	c.PrependReactor("create", "resourceslices", strip)
	c.PrependReactor("update", "resourceslices", strip)
}

// TestDynamicMIGFallsBackWhenTheAPIServerDropsPartitionableDevices: without
// counters the scheduler could hand out overlapping partitions, so the
// plugin stops offering partitions and publishes whole GPUs instead, and a
// partition that exists already as what it is.
func TestDynamicMIGFallsBackWhenTheAPIServerDropsPartitionableDevices(t *testing.T) {
	h := startWith(t, func(dir string, o *plugin.Options) {
		o.Node = nodeopen.Options{NodeName: nodeName, FakeNode: "dgx-h100", FakeRoot: filepath.Join(dir, "host")}
	})
	// A partition prepared while the API server still kept the counters
	// keeps its GPU from whole use after the fallback.
	if _, msg := h.prepare(h.claim("early", "gpu-1-mig-1g10gb-6")); msg != "" {
		t.Fatal(msg)
	}
	h.plugin.Stop()
	// The node's slices are gone (as when a kubelet restarts) and the API
	// server it comes back to drops partitionable devices.
	list, err := h.client.ResourceV1().ResourceSlices().List(h.ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range list.Items {
		if err := h.client.ResourceV1().ResourceSlices().Delete(h.ctx, s.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	withoutPartitionableDevices(h.client)
	h.restart()
	// The partition still exists on gpu-1 (the driver keeps it across
	// the plugin's restart): gpu-1 is published as that partition, as an
	// operator's static MIG layout would be, and not whole.
	wantAfterFallback := []string{"gpu-0", "gpu-1-mig-1g10gb-6", "gpu-2", "gpu-3", "gpu-4", "gpu-5", "gpu-6", "gpu-7"}
	var names []string
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		list, err := h.client.ResourceV1().ResourceSlices().List(h.ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		names = names[:0]
		for _, s := range list.Items {
			for _, d := range s.Spec.Devices {
				names = append(names, d.Name)
			}
		}
		slices.Sort(names)
		if slices.Equal(names, wantAfterFallback) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !slices.Equal(names, wantAfterFallback) {
		t.Fatalf("published %v after the fallback, want the whole GPUs and gpu-1's held partition %v", names, wantAfterFallback)
	}
	if _, msg := h.prepare(h.claim("part", "gpu-0-mig-1g10gb-6")); !strings.Contains(msg, "does not exist on node") {
		t.Errorf("a partition was prepared after the fallback: %q", msg)
	}
	if _, msg := h.prepare(h.claim("whole", "gpu-0")); msg != "" {
		t.Errorf("whole GPU after the fallback: %s", msg)
	}
	if _, msg := h.prepare(h.claim("under", "gpu-1")); !strings.Contains(msg, "allocated device gpu-1 does not exist on node") {
		t.Errorf("whole gpu-1 while its partition is held: %q, want it refused as not published", msg)
	}
}

// withoutConsumableCapacity makes the fake API server drop what consumable
// capacity adds, as one with DRAConsumableCapacity off does.
func withoutConsumableCapacity(c *fake.Clientset) {
	dropFromSlices(c, func(s *resourceapi.ResourceSlice) {
		for i := range s.Spec.Devices {
			d := &s.Spec.Devices[i]
			d.AllowMultipleAllocations = nil
			for name, c := range d.Capacity {
				c.RequestPolicy = nil
				d.Capacity[name] = c
			}
		}
	})
}

// TestSharedGPUsAreWithdrawnWhenTheAPIServerDropsConsumableCapacity: a shared
// GPU stripped of allowMultipleAllocations would look exclusive and be handed
// out whole, so the plugin republishes it as an ordinary whole GPU.
func TestSharedGPUsAreWithdrawnWhenTheAPIServerDropsConsumableCapacity(t *testing.T) {
	h := startWith(t, func(dir string, o *plugin.Options) {
		o.Node = nodeopen.Options{NodeName: nodeName, FakeNode: "pcie-l4x4", FakeRoot: filepath.Join(dir, "host")}
		o.TimeSlicedGPUs = "0=4"
		if err := o.Sharing.ParseTimeSliced(o.TimeSlicedGPUs); err != nil {
			t.Fatal(err)
		}
	}, withoutConsumableCapacity)
	deadline := time.Now().Add(20 * time.Second)
	var shared bool
	for time.Now().Before(deadline) {
		list, err := h.client.ResourceV1().ResourceSlices().List(h.ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		shared = false
		for _, s := range list.Items {
			for _, d := range s.Spec.Devices {
				if _, ok := d.Capacity["timeSlices"]; ok {
					shared = true
				}
			}
		}
		if len(list.Items) > 0 && !shared {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if shared {
		t.Fatal("gpu-0 is still published with time slices after the API server dropped consumable capacity")
	}
	if _, msg := h.prepare(h.claim("whole", "gpu-0")); msg != "" {
		t.Errorf("gpu-0 as a whole GPU after the fallback: %s", msg)
	}
}
