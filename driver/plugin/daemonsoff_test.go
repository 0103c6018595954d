package plugin_test

import (
	"slices"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/tessera-dev/tessera/driver/daemonpod"
	"github.com/tessera-dev/tessera/driver/imex"
	"github.com/tessera-dev/tessera/driver/plugin"
)

// daemonsRun makes the fake API server's daemon pods run as soon as they
// are created: no kubelet runs them here.
func daemonsRun(c *fake.Clientset) {
	c.PrependReactor("create", "pods", func(action k8stesting.Action) (bool, runtime.Object, error) {
		pod := action.(k8stesting.CreateAction).GetObject().(*v1.Pod)
		pod.Status.Phase = v1.PodRunning
		for _, ctr := range pod.Spec.Containers {
			pod.Status.ContainerStatuses = append(pod.Status.ContainerStatuses, v1.ContainerStatus{Name: ctr.Name, Ready: true, State: v1.ContainerState{Running: &v1.ContainerStateRunning{}}})
		}
		pod.Status.Conditions = []v1.PodCondition{{Type: v1.PodReady, Status: v1.ConditionTrue}}
		return false, nil, nil
	})
}

// daemonPods lists the names of the pods of one kind of daemon (app).
func (h *harness) daemonPods(app string) []string {
	h.t.Helper()
	pods, err := h.client.CoreV1().Pods("tessera-system").List(h.ctx, metav1.ListOptions{LabelSelector: daemonpod.LabelApp + "=" + app})
	if err != nil {
		h.t.Fatal(err)
	}
	var names []string
	for _, p := range pods.Items {
		names = append(names, p.Name)
	}
	slices.Sort(names)
	return names
}

// TestTurningMPSOffStillStopsTheDaemonsItStarted: an operator who removes
// the plugin's MPS image (--mps-image) while a claim's MPS daemon runs gets
// new MPS claims refused, naming the flag, and the running claim's unprepare
// still stops its daemon: stopping needs no image, and an unprepare that
// fails leaves the pod that used the claim stuck terminating.
func TestTurningMPSOffStillStopsTheDaemonsItStarted(t *testing.T) {
	h, _ := startOnFakeNode(t, "pcie-l4x4", func(o *plugin.Options) {
		o.MPSImage, o.Namespace = "pause", "tessera-system"
	}, daemonsRun)
	const mpsConfig = `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS"}}`
	running := h.claimWithConfig("running", mpsConfig, "gpu-0")
	if _, msg := h.prepare(running); msg != "" {
		t.Fatal(msg)
	}
	if got := h.daemonPods("tessera-mps"); len(got) != 1 {
		t.Fatalf("MPS daemon pods after the prepare: %v, want one", got)
	}

	h.opts.MPSImage = ""
	h.restart()
	if _, msg := h.prepare(h.claimWithConfig("new", mpsConfig, "gpu-1")); !strings.Contains(msg, "--mps-image") {
		t.Errorf("prepare of a new MPS claim with MPS off: %q, want a refusal naming --mps-image", msg)
	}
	resp, err := h.kubelet.Unprepare(h.ctx, running)
	if err != nil {
		t.Fatal(err)
	}
	if msg := resp.Claims[string(running.UID)].GetError(); msg != "" {
		t.Fatalf("unprepare of the claim whose daemon runs, with MPS off: %s", msg)
	}
	if got := h.daemonPods("tessera-mps"); len(got) != 0 {
		t.Errorf("MPS daemon pods after the unprepare: %v, want none", got)
	}
}

// TestTheDaemonSweepStopsIMEXDaemonsWithIMEXOff: with the plugin's IMEX
// daemons turned off (no --imex-image; the chart's
// kubeletPlugin.imex.enabled false), an IMEX daemon pod left on the node
// for a claim the node does not hold is still deleted by the sweep at start.
func TestTheDaemonSweepStopsIMEXDaemonsWithIMEXOff(t *testing.T) {
	orphan := "tessera-imex-uid-gone-" + nodeName
	h, _ := startOnFakeNode(t, "pcie-l4x4", func(o *plugin.Options) { o.Namespace = "tessera-system" }, func(c *fake.Clientset) {
		pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: orphan, Namespace: "tessera-system", Labels: map[string]string{
			daemonpod.LabelApp: imex.AppName, daemonpod.LabelNode: nodeName, daemonpod.LabelClaimUID: "uid-gone",
		}}}
		if err := c.Tracker().Add(pod); err != nil {
			t.Fatal(err)
		}
	})
	deadline := time.Now().Add(10 * time.Second)
	for got := h.daemonPods(imex.AppName); len(got) != 0; got = h.daemonPods(imex.AppName) {
		if time.Now().After(deadline) {
			t.Fatalf("IMEX daemon pods 10 s after the plugin started: %v, want the orphan %s deleted", got, orphan)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
