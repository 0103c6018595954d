package e2e

import (
	"context"
	"maps"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/tessera-dev/tessera/test/gpunode"
)

// sliceWipeDelay is how long the kubelet keeps the ResourceSlices of a plugin
// that unregistered before deleting them.
const sliceWipeDelay = 30 * time.Second

// TestRestartsKeepRunningPodsAndRestoreSlices restarts the kubelet and the
// plugin under a running GPU pod: the pod is never touched, the plugin is
// registered again, a short plugin restart keeps the published slices, and a
// long absence loses them until the plugin returns. The subtests run in
// order on one node.
func TestRestartsKeepRunningPodsAndRestoreSlices(t *testing.T) {
	t.Parallel()
	c := startTessera(t, l4Node)
	ctx, cancel := context.WithTimeout(t.Context(), 6*time.Minute)
	defer cancel()
	node := c.nodes[l4Node.name]
	client := c.Client()
	const ns = "restarts"
	c.newNamespace(ctx, t, ns)
	c.createTemplates(ctx, t, gpuTemplate(ns, "one-gpu", 1))
	withGPU := func(name string) *corev1.Pod {
		return newGPUPod(ns, name, gpuFrom("one-gpu"))
	}
	survivor := c.createAndRun(ctx, t, withGPU("survivor"))
	survivorContainer := c.containerOf(t, survivor)
	// checkSurvivor checks that the first pod still runs its first container.
	checkSurvivor := func(t *testing.T) {
		t.Helper()
		pod, err := client.CoreV1().Pods(ns).Get(ctx, survivor.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if pod.Status.Phase != corev1.PodRunning || pod.UID != survivor.UID {
			t.Errorf("pod %s is %s (UID %s), want the same pod Running", pod.Name, pod.Status.Phase, pod.UID)
		}
		for _, cs := range pod.Status.ContainerStatuses {
			if cs.RestartCount != 0 || cs.ContainerID != "fakeRuntime://"+survivorContainer.ID {
				t.Errorf("pod %s: container %s is %s with %d restarts, want %s never restarted", pod.Name, cs.Name, cs.ContainerID, cs.RestartCount, survivorContainer.ID)
			}
		}
		if rc := c.containerOf(t, pod); rc.ID != survivorContainer.ID {
			t.Errorf("pod %s: runtime holds container %s, want the original %s", pod.Name, rc.ID, survivorContainer.ID)
		}
	}
	// runAnother shows the kubelet reaches the plugin: a new pod's claim is
	// prepared and its container gets the GPU.
	runAnother := func(t *testing.T, name string) {
		t.Helper()
		pod := c.createAndRun(ctx, t, withGPU(name))
		checkGPUContainer(t, node, c.containerOf(t, pod), allocatedDevices(c.claimOf(ctx, t, pod, "gpu")))
	}

	t.Run("KubeletRestartReregistersPluginAndLeavesPodsRunning", func(t *testing.T) {
		c.LogsOnFailure(t)
		before, err := gpunode.ListSlices(ctx, client, node.Name())
		if err != nil {
			t.Fatal(err)
		}
		registrations, err := node.DRAPluginRegistrations(gpuClass)
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		if err := node.RestartKubelet(ctx); err != nil {
			t.Fatal(err)
		}
		if err := node.WaitRegistered(ctx, registrations); err != nil {
			t.Fatal(err)
		}
		t.Logf("plugin registered with the restarted kubelet after %v", time.Since(start).Round(time.Millisecond))
		checkSurvivor(t)
		// The starting kubelet deletes the node's slices; the plugin's slice
		// controller publishes them again after its 30 s sync delay.
		var after gpunode.SliceIDs
		err = wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
			ids, err := gpunode.WaitForSlices(ctx, client, node.Name(), 10*time.Second)
			if err != nil {
				return false, nil
			}
			for _, uid := range ids {
				for _, old := range before {
					if uid == old {
						return false, nil
					}
				}
			}
			after = ids
			return true, nil
		})
		if err != nil {
			t.Fatalf("slices not republished after the kubelet restart (before: %v): %v", before, err)
		}
		t.Logf("slices republished %v after the kubelet restart began: %v", time.Since(start).Round(time.Second), after)
		checkSurvivor(t)
		runAnother(t, "after-kubelet-restart")
	})

	t.Run("PluginRestartWithin30sKeepsSlices", func(t *testing.T) {
		c.LogsOnFailure(t)
		before, err := gpunode.WaitForSlices(ctx, client, node.Name(), time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		stopped := time.Now()
		node.StopPlugin()
		if err := node.StartPlugin(); err != nil {
			t.Fatal(err)
		}
		t.Logf("plugin restarted in %v", time.Since(stopped).Round(time.Millisecond))
		runAnother(t, "after-plugin-restart")
		// Watch past the kubelet's wipe delay: the slices must stay as they
		// were, not be deleted and created again.
		deadline := stopped.Add(sliceWipeDelay + 10*time.Second)
		for time.Now().Before(deadline) {
			now, err := gpunode.ListSlices(ctx, client, node.Name())
			if err != nil {
				t.Fatal(err)
			}
			if !maps.Equal(now, before) {
				t.Fatalf("%v after the plugin restart its slices changed from %v to %v", time.Since(stopped).Round(time.Millisecond), before, now)
			}
			select {
			case <-ctx.Done():
				t.Fatal(ctx.Err())
			case <-time.After(500 * time.Millisecond):
			}
		}
		checkSurvivor(t)
	})

	t.Run("PluginGoneOver30sLosesSlicesUntilItReturns", func(t *testing.T) {
		c.LogsOnFailure(t)
		before, err := gpunode.WaitForSlices(ctx, client, node.Name(), time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		stopped := time.Now()
		node.StopPlugin()
		eventually(ctx, t, sliceWipeDelay+time.Minute, "slices wiped after the plugin left", func() bool {
			ids, err := gpunode.ListSlices(ctx, client, node.Name())
			return err == nil && len(ids) == 0
		})
		gone := time.Since(stopped)
		t.Logf("slices wiped %v after the plugin stopped", gone.Round(time.Millisecond))
		if gone < sliceWipeDelay-5*time.Second {
			t.Errorf("slices wiped %v after the plugin stopped, want the kubelet's %v grace", gone, sliceWipeDelay)
		}
		checkSurvivor(t)

		if err := node.StartPlugin(); err != nil {
			t.Fatal(err)
		}
		after, err := gpunode.WaitForSlices(ctx, client, node.Name(), time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("slices restored %v after the plugin returned (before %v, now %v)", time.Since(stopped)-gone, before, after)
		runAnother(t, "after-plugin-return")
		checkSurvivor(t)
	})
}
