package e2e

import (
	"context"
	"fmt"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	schedulingv1beta1 "k8s.io/api/scheduling/v1beta1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/utils/ptr"

	"github.com/tessera-dev/tessera/controller/nodelabels"
	"github.com/tessera-dev/tessera/test/cluster"
)

// TestAPodGroupKeepsToOneNVLinkCliqueByTheControllersLabels: tessera-
// controller, as its own service account under the shipped RBAC and
// policies, labels each GB200 tray with the NVLink domain and clique its
// GPUs publish, and the scheduler's own topology-aware workload scheduling
// (Kubernetes 1.37, alpha gates on) keeps a PodGroup of three whole trays,
// with no Tessera gang or domain claim, in the one clique that has three:
// clique A has two trays, clique B three. Without the labels the group
// could not be placed at all (the constraint names a label no node has).
func TestAPodGroupKeepsToOneNVLinkCliqueByTheControllersLabels(t *testing.T) {
	t.Parallel()
	const (
		domain  = "7c1f0e2a-9d4b-4e6a-b3f8-2a5c9e1d7b40"
		cliqueA = domain + ".1"
		cliqueB = domain + ".2"
		ns      = "tas"
	)
	trays := map[string]string{"tray-a1": cliqueA, "tray-a2": cliqueA, "tray-b1": cliqueB, "tray-b2": cliqueB, "tray-b3": cliqueB}
	var specs []gpuNodeSpec
	for _, name := range []string{"tray-a1", "tray-a2", "tray-b1", "tray-b2", "tray-b3"} {
		specs = append(specs, gpuNodeSpec{name: name, profile: "gb200-nvl72-tray", clique: trays[name]})
	}
	c := startTesseraWith(t, cluster.Options{CompositePodGroups: true}, specs...)
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
	defer cancel()
	installAndStartController(ctx, t, c.Cluster, "")
	client := c.Client()

	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		for name, clique := range trays {
			n, err := client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
			if err != nil || n.Labels[nodelabels.LabelClique] != clique || n.Labels[nodelabels.LabelDomain] != domain {
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		got := map[string]map[string]string{}
		for name := range trays {
			if n, err := client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{}); err == nil {
				got[name] = map[string]string{nodelabels.LabelClique: n.Labels[nodelabels.LabelClique], nodelabels.LabelDomain: n.Labels[nodelabels.LabelDomain]}
			}
		}
		t.Fatalf("the trays' NVLink labels are %v, want each its clique of %v and domain %s", got, trays, domain)
	}

	noErr(t, c.CreateNamespace(ctx, ns))
	c.createTemplates(ctx, t, gpuTemplate(ns, "tray", 4))
	pg := &schedulingv1beta1.PodGroup{
		ObjectMeta: metav1.ObjectMeta{Name: "tp", Namespace: ns},
		Spec: schedulingv1beta1.PodGroupSpec{
			SchedulingPolicy:      schedulingv1beta1.PodGroupSchedulingPolicy{Gang: &schedulingv1beta1.GangSchedulingPolicy{MinCount: 3}},
			SchedulingConstraints: &schedulingv1beta1.PodGroupSchedulingConstraints{Topology: []schedulingv1beta1.TopologyConstraint{{Key: nodelabels.LabelClique}}},
		},
	}
	noErr(t, ok(client.SchedulingV1beta1().PodGroups(ns).Create(ctx, pg, metav1.CreateOptions{})))
	var names []string
	for i := range 3 {
		p := newGPUPod(ns, fmt.Sprintf("tp-%d", i), corev1.PodResourceClaim{Name: "gpu", ResourceClaimTemplateName: ptr.To("tray")})
		p.Spec.SchedulingGroup = &corev1.PodSchedulingGroup{PodGroupName: ptr.To("tp")}
		noErr(t, ok(client.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{})))
		names = append(names, p.Name)
	}
	running := c.waitNamedRunning(ctx, t, ns, 3*time.Minute, names...)
	nodes := map[string]bool{}
	for name, p := range running {
		nodes[p.Spec.NodeName] = true
		if trays[p.Spec.NodeName] != cliqueB {
			t.Errorf("pod %s runs on %s, outside clique B", name, p.Spec.NodeName)
		}
	}
	if len(nodes) != 3 {
		t.Errorf("the group's three pods of a whole tray each run on %d trays: %v", len(nodes), nodes)
	}
}
