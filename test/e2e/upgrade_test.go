package e2e

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/checkpoint/checkpointtest"
)

// TestUpgradeKeepsPodsTheFirstReleasePrepared starts the current plugin over
// a node whose checkpoint the first release wrote (format version 1 without
// the fields added since, as checkpointtest.EncodeV1 writes it; that writer
// is held to the pinned testdata/v1.json). The CDI spec is left as the
// current plugin wrote it: its format (file name, kind, claim annotations)
// is unchanged since the first release. The running pod is untouched, the
// new plugin knows its claim, and deleting the pod unprepares it cleanly.
func TestUpgradeKeepsPodsTheFirstReleasePrepared(t *testing.T) {
	t.Parallel()
	c := startTessera(t, l4Node)
	ctx, cancel := context.WithTimeout(t.Context(), 4*time.Minute)
	defer cancel()
	node := c.nodes[l4Node.name]
	const ns = "upgrade"
	c.newNamespace(ctx, t, ns)
	c.createTemplates(ctx, t, gpuTemplate(ns, "one-gpu", 1))
	pod := c.createAndRun(ctx, t, newGPUPod(ns, "old", gpuFrom("one-gpu")))
	claim := c.claimOf(ctx, t, pod, "gpu")
	container := c.containerOf(t, pod)
	specPath := node.cdiSpecPath(t, claim)
	spec, err := os.ReadFile(specPath)
	if err != nil {
		t.Fatalf("CDI spec of the running pod's claim: %v", err)
	}

	// The old plugin leaves; what it leaves behind is in the old format.
	node.StopPlugin()
	store, err := checkpoint.NewStore(node.Options.PluginDataDir)
	if err != nil {
		t.Fatal(err)
	}
	data, err := store.Load()
	if err != nil {
		t.Fatal(err)
	}
	old, err := checkpointtest.EncodeV1(data)
	if err != nil {
		t.Fatalf("the claim is not one the first release could have prepared: %v", err)
	}
	if err := store.Write(old); err != nil {
		t.Fatal(err)
	}

	start := time.Now()
	if err := node.StartPlugin(); err != nil {
		t.Fatal(err)
	}
	t.Logf("new plugin registered %v after starting over the first release's checkpoint", time.Since(start).Round(time.Millisecond))
	checkPodUntouched(ctx, t, c, pod, container.ID)
	// The new plugin read the file rather than rebuilding it: nothing was
	// quarantined as corrupt, the claim is still recorded as prepared, and
	// its CDI spec was not taken for an orphan.
	if moved, _ := filepath.Glob(store.Path() + ".corrupt-*"); len(moved) > 0 {
		t.Errorf("the first release's checkpoint was taken for corrupt and moved to %v", moved)
	}
	checkPrepared(t, store, claim, allocatedDevices(claim))
	if now, err := os.ReadFile(specPath); err != nil || string(now) != string(spec) {
		t.Errorf("CDI spec of the running pod's claim changed or vanished over the upgrade (err %v)", err)
	}

	// Deleting the pod unprepares the claim: spec gone, checkpoint empty,
	// and its GPU serves a new pod that asks for exactly that GPU.
	c.deletePodsAndWait(ctx, t, pod)
	waitNoCDISpecs(ctx, t, node)
	waitCheckpointEmpty(ctx, t, node)
	device := allocatedDevices(claim)[0]
	uuid := node.gpuOf(t, device).uuid
	again := gpuTemplate(ns, "that-gpu", 1)
	again.Spec.Spec.Devices.Requests[0].Exactly.Selectors = []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{
		Expression: `device.attributes["gpu.tessera.dev"].uuid == "` + uuid + `"`,
	}}}
	c.createTemplates(ctx, t, again)
	next := c.createAndRun(ctx, t, newGPUPod(ns, "new", gpuFrom("that-gpu")))
	checkGPUContainer(t, node, c.containerOf(t, next), []string{device})
	checkNoWarnings(ctx, t, c, ns)
}

// checkPodUntouched checks that the pod still runs, with the same UID and
// its first container never restarted.
func checkPodUntouched(ctx context.Context, t *testing.T, c *tesseraCluster, pod *corev1.Pod, containerID string) {
	t.Helper()
	now, err := c.Client().CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if now.Status.Phase != corev1.PodRunning || now.UID != pod.UID {
		t.Errorf("pod %s is %s (UID %s), want the same pod Running", pod.Name, now.Status.Phase, now.UID)
	}
	for _, cs := range now.Status.ContainerStatuses {
		if cs.RestartCount != 0 || cs.ContainerID != "fakeRuntime://"+containerID {
			t.Errorf("pod %s: container %s is %s with %d restarts, want %s never restarted", pod.Name, cs.Name, cs.ContainerID, cs.RestartCount, containerID)
		}
	}
}

// checkPrepared checks that the checkpoint records the claim as prepared
// with exactly these devices.
func checkPrepared(t *testing.T, store *checkpoint.Store, claim *resourceapi.ResourceClaim, devices []string) {
	t.Helper()
	data, err := store.Load()
	if err != nil {
		t.Fatal(err)
	}
	got, ok := data.Claims[string(claim.UID)]
	if !ok || got.Phase != checkpoint.PrepareCompleted {
		t.Fatalf("checkpoint holds claim %s/%s as %+v (recorded: %v), want PrepareCompleted", claim.Namespace, claim.Name, got, ok)
	}
	var held []string
	for _, d := range got.Devices {
		held = append(held, d.Device)
	}
	sort.Strings(held)
	if !slices.Equal(held, devices) {
		t.Errorf("checkpoint holds %v for claim %s, want %v", held, claim.Name, devices)
	}
}

// checkNoWarnings fails on any Warning event in ns but the harness's own
// (the local kubelets have no cluster DNS).
func checkNoWarnings(ctx context.Context, t *testing.T, c *tesseraCluster, ns string) {
	t.Helper()
	events, err := c.Client().CoreV1().Events(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range events.Items {
		if e.Type == corev1.EventTypeWarning && e.Reason != "MissingClusterDNS" {
			t.Errorf("warning %s %s/%s: %s", e.Reason, e.InvolvedObject.Kind, e.InvolvedObject.Name, e.Message)
		}
	}
}
