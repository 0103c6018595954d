package e2e

import (
	"context"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/test/cluster"
)

// TestRebootPreparesClaimsAfreshAndLeaksNothing reboots a node under a
// whole-GPU pod and a MIG pod: kubelet and plugin stop, every container and
// MIG instance is gone, GPU settings reset, the boot ID changes, and both
// start again. The plugin discards the previous boot's claims (their CDI
// specs are removed at start, not reused), the kubelet re-creates the pods'
// containers and prepares their claims again through the plugin, and the
// node ends with exactly one checkpoint entry, one CDI spec and, for the MIG
// claim, one GPU instance per pod.
func TestRebootPreparesClaimsAfreshAndLeaksNothing(t *testing.T) {
	t.Parallel()
	c := startTessera(t, h100Node)
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
	defer cancel()
	node := c.nodes[h100Node.name]
	const ns = "reboot"
	c.newNamespace(ctx, t, ns)
	c.createTemplates(ctx, t, gpuTemplate(ns, "one-gpu", 1), migTemplate(ns, "one-slice", "1g.10gb"))
	whole := c.createAndRun(ctx, t, newGPUPod(ns, "whole", gpuFrom("one-gpu")))
	mig := c.createAndRun(ctx, t, newGPUPod(ns, "mig", gpuFrom("one-slice")))
	pods := []*corev1.Pod{whole, mig}
	claims := map[string]*resourceapi.ResourceClaim{}
	for _, p := range pods {
		claims[p.Name] = c.claimOf(ctx, t, p, "gpu")
	}
	instances := func() int {
		total := 0
		for i := range node.gpuCount(t) {
			total += node.Fake.GPUInstances(i)
		}
		return total
	}
	if n := instances(); n != 1 {
		t.Fatalf("%d GPU instances before the reboot, want the MIG pod's one", n)
	}

	// The node goes down and comes back with a new boot ID.
	start := time.Now()
	node.StopPlugin()
	node.StopKubelet()
	if err := node.DropContainers(); err != nil {
		t.Fatal(err)
	}
	if err := node.Fake.Reboot(); err != nil {
		t.Fatal(err)
	}
	if n := instances(); n != 0 {
		t.Fatalf("%d GPU instances after the reboot, want none", n)
	}
	if err := os.WriteFile(node.Options.BootIDFile, []byte("0d6e2c44-7f0b-4c53-9a0e-2b8f1e7d3c91\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := node.StartKubelet(ctx); err != nil {
		t.Fatal(err)
	}
	if err := node.StartPlugin(); err != nil {
		t.Fatal(err)
	}
	for _, p := range pods {
		// The runtime forgot the old containers: a recorded one is new.
		eventually(ctx, t, 2*time.Minute, "pod "+p.Name+" running in a new container", func() bool {
			return hasContainer(node.Containers(), p) && isRunning(ctx, c, p)
		})
	}
	t.Logf("both pods run again %v after the reboot began", time.Since(start).Round(time.Millisecond))

	store, err := checkpoint.NewStore(node.Options.PluginDataDir)
	if err != nil {
		t.Fatal(err)
	}
	data, err := store.Load()
	if err != nil {
		t.Fatal(err)
	}
	if data.BootID != "0d6e2c44-7f0b-4c53-9a0e-2b8f1e7d3c91" {
		t.Errorf("checkpoint written under boot ID %q, want the new boot's", data.BootID)
	}
	if len(data.Claims) != len(pods) {
		t.Errorf("checkpoint holds %d claims after the reboot, want %d: %+v", len(data.Claims), len(pods), data.Claims)
	}
	// One claim spec per pod, and one device metadata spec (the kubelet
	// plugin helper's, DeviceMetadata) for each claim's one request.
	var own, metadata []string
	for _, s := range node.cdiSpecs() {
		if strings.HasPrefix(s, "gpu.tessera.dev_metadata_") {
			metadata = append(metadata, s)
		} else {
			own = append(own, s)
		}
	}
	if len(own) != len(pods) || len(metadata) != len(pods) {
		t.Errorf("CDI dir holds claim specs %v and metadata specs %v after the reboot, want one of each per pod", own, metadata)
	}
	for _, p := range pods {
		if uid := string(claims[p.Name].UID); !slices.ContainsFunc(metadata, func(s string) bool { return strings.Contains(s, "_"+uid+"_") }) {
			t.Errorf("pod %s: no metadata spec of its claim %s among %v", p.Name, uid, metadata)
		}
	}
	if n := instances(); n != 1 {
		t.Errorf("%d GPU instances after the reboot, want the MIG pod's one", n)
	}
	for _, p := range pods {
		claim := claims[p.Name]
		if now := c.claimOf(ctx, t, p, "gpu"); now.UID != claim.UID {
			t.Errorf("pod %s runs with claim %s, want its claim %s from before the reboot", p.Name, now.UID, claim.UID)
		}
		checkPrepared(t, store, claim, allocatedDevices(claim))
		// Written after the reboot: the stale spec was removed at start and
		// the claim prepared again, not answered from the previous boot's
		// record (which would leave the old file).
		fi, err := os.Stat(node.cdiSpecPath(t, claim))
		if err != nil {
			t.Fatalf("pod %s: CDI spec of claim %s: %v", p.Name, claim.Name, err)
		}
		if !fi.ModTime().After(start) {
			t.Errorf("pod %s: CDI spec of claim %s was written at %v, before the reboot began at %v", p.Name, claim.Name, fi.ModTime(), start)
		}
	}
	checkGPUContainer(t, node, c.containerOf(t, whole), allocatedDevices(claims[whole.Name]))
	if visible := c.containerOf(t, mig).EnvMap()["NVIDIA_VISIBLE_DEVICES"]; !strings.HasPrefix(visible, "MIG-") {
		t.Errorf("MIG pod's new container got NVIDIA_VISIBLE_DEVICES=%q, want a MIG-<uuid>", visible)
	}

	c.deletePodsAndWait(ctx, t, pods...)
	waitNoCDISpecs(ctx, t, node)
	eventually(ctx, t, time.Minute, "MIG instance destroyed after the pods were deleted", func() bool { return instances() == 0 })
	waitCheckpointEmpty(ctx, t, node)
}

// hasContainer reports whether the runtime recorded the pod's main container.
func hasContainer(recorded []cluster.RecordedContainer, pod *corev1.Pod) bool {
	for _, rc := range recorded {
		if rc.PodUID == string(pod.UID) && rc.Name == "main" {
			return true
		}
	}
	return false
}

func isRunning(ctx context.Context, c *tesseraCluster, pod *corev1.Pod) bool {
	now, err := c.Client().CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
	return err == nil && now.UID == pod.UID && now.Status.Phase == corev1.PodRunning
}
