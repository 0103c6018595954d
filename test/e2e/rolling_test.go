package e2e

import (
	"context"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/tessera-dev/tessera/driver/plugin"
	"github.com/tessera-dev/tessera/test/gpunode"
)

// TestRollingUpdateServesEveryCallWithTwoPluginInstances plays a DaemonSet
// rolling update with surge on one node: the old plugin pod (rolling-update
// mode, --pod-uid) serves two GPU pods, the new one starts beside it and
// registers, a pod is created and one of the old instance's is deleted while
// both serve, then the old one stops and the new one serves alone: it
// unprepares the old one's other pod, and no prepare or unprepare fails.
// Both share the node's checkpoint, which ends empty.
func TestRollingUpdateServesEveryCallWithTwoPluginInstances(t *testing.T) {
	t.Parallel()
	spec := l4Node
	spec.options = func(o *plugin.Options) { o.PodUID = "plugin-pod-old" }
	c := startTessera(t, spec)
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
	defer cancel()
	node := c.nodes[spec.name]
	client := c.Client()
	const ns = "rolling"
	c.newNamespace(ctx, t, ns)
	c.createTemplates(ctx, t, gpuTemplate(ns, "one-gpu", 1))
	withGPU := func(name string) *corev1.Pod {
		return newGPUPod(ns, name, gpuFrom("one-gpu"))
	}
	before := c.createAndRun(ctx, t, withGPU("before"))
	kept := c.createAndRun(ctx, t, withGPU("kept"))

	// The new pod of the DaemonSet starts beside the old one.
	registrations, err := node.DRAPluginRegistrations(gpunode.DriverName)
	if err != nil {
		t.Fatal(err)
	}
	pluginClient, err := gpunode.PluginClient(ctx, c.Cluster)
	if err != nil {
		t.Fatal(err)
	}
	newOpts := node.Options
	newOpts.PodUID = "plugin-pod-new"
	newer, err := plugin.Start(ctx, newOpts, pluginClient)
	if err != nil {
		t.Fatal(err)
	}
	defer newer.Stop()
	if err := node.WaitRegistered(ctx, registrations); err != nil {
		t.Fatal(err)
	}
	// While both serve: a pod comes, and one the old instance prepared
	// goes (the kubelet may call either instance).
	during := c.createAndRun(ctx, t, withGPU("during"))
	specGone := func(pod *corev1.Pod) func() bool {
		claim := string(c.claimOf(ctx, t, pod, "gpu").UID)
		return func() bool { return !strings.Contains(strings.Join(node.cdiSpecs(), " "), claim) }
	}
	beforeGone := specGone(before)
	deletePods(ctx, t, c, before)
	waitFor(ctx, t, "the CDI spec of a pod deleted while both instances serve removed", beforeGone)

	// The old pod terminates; the new one serves alone and unprepares
	// what the old one prepared.
	node.StopPlugin()
	keptGone := specGone(kept)
	deletePods(ctx, t, c, kept)
	waitFor(ctx, t, "the old instance's pod's CDI spec removed by the new instance", keptGone)
	after := c.createAndRun(ctx, t, withGPU("after"))
	deletePods(ctx, t, c, during, after)
	waitFor(ctx, t, "every claim unprepared", func() bool { return len(node.cdiSpecs()) == 0 })

	// Both instances wrote one checkpoint: it ends empty, with nothing
	// held by a claim the old instance prepared.
	waitCheckpointEmpty(ctx, t, node)

	events, err := client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range events.Items {
		// The local kubelets have no cluster DNS; that warning is the
		// harness's, not the driver's.
		if e.Type == corev1.EventTypeWarning && e.Reason != "MissingClusterDNS" {
			t.Errorf("a call failed during the rolling update: %s %s/%s: %s", e.Reason, e.InvolvedObject.Kind, e.InvolvedObject.Name, e.Message)
		}
	}
}
