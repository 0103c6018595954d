package e2e

import (
	"context"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"

	"github.com/tessera-dev/tessera/driver/plugin"
)

// examplesDir holds the workloads operators copy.
const examplesDir = "../../deployments/examples"

// pendingExamples are the example pods meant not to fit anywhere.
var pendingExamples = map[string]bool{"too-many-gpus": true}

// TestEveryExampleRunsOnTheLocalCluster applies every file of
// deployments/examples, as a user would, on nodes that have what the
// examples ask for: two DGX H100s (MIG, NVLink, power caps) and an L4
// server whose GPU 0 is cut into four time slices and GPU 1 is shared by
// memory, every plugin with MPS enabled (as the chart's default image does). Every pod they create runs, except the one written not
// to fit, which the scheduler leaves Unschedulable.
func TestEveryExampleRunsOnTheLocalCluster(t *testing.T) {
	withMPS := func(o *plugin.Options) { o.MPSImage = pause }
	tc := startTessera(t,
		gpuNodeSpec{name: "dgx-1", profile: "dgx-h100", options: withMPS},
		gpuNodeSpec{name: "dgx-2", profile: "dgx-h100", options: withMPS},
		gpuNodeSpec{name: "l4-shared", profile: "pcie-l4x4", options: func(o *plugin.Options) {
			withMPS(o)
			o.TimeSlicedGPUs = "0=4"
			o.MemorySharedGPUs = "1"
		}},
	)
	ctx, cancel := context.WithTimeout(t.Context(), 6*time.Minute)
	defer cancel()

	var files []string
	err := filepath.WalkDir(examplesDir, func(path string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() && strings.HasSuffix(path, ".yaml") {
			files = append(files, path)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(files)
	pods := map[string]string{} // pod or Deployment name -> file
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if err := tc.Apply(ctx, data); err != nil {
			t.Fatalf("apply %s: %v", f, err)
		}
		for _, obj := range decodeAll(t, f, data) {
			if k := obj.GetKind(); k == "Pod" || k == "Deployment" {
				pods[obj.GetName()] = filepath.Base(f)
			}
		}
	}
	if len(pods) < 12 {
		t.Fatalf("found %d example workloads, want every example's (at least 12): %v", len(pods), pods)
	}
	client := tc.Client()
	for name, file := range pods {
		if pendingExamples[name] {
			tc.waitForPod(ctx, t, metav1.NamespaceDefault, name, "unschedulable", 2*time.Minute, unschedulable)
			continue
		}
		if _, err := client.AppsV1().Deployments(metav1.NamespaceDefault).Get(ctx, name, metav1.GetOptions{}); err == nil {
			waitFor(ctx, t, "every replica of "+name+" ("+file+") running", func() bool {
				d, err := client.AppsV1().Deployments(metav1.NamespaceDefault).Get(ctx, name, metav1.GetOptions{})
				return err == nil && d.Spec.Replicas != nil && d.Status.ReadyReplicas == *d.Spec.Replicas
			})
			continue
		}
		pod := tc.waitForPod(ctx, t, metav1.NamespaceDefault, name, "Running ("+file+")", 2*time.Minute, func(p *corev1.Pod) bool {
			return p.Status.Phase == corev1.PodRunning
		})
		var got bool
		for _, rc := range tc.Node(pod.Spec.NodeName).Containers() {
			if rc.PodUID == string(pod.UID) {
				got = rc.EnvMap()["NVIDIA_VISIBLE_DEVICES"] != ""
			}
		}
		if !got {
			t.Errorf("%s (%s): no container of the pod got a GPU on %s", name, file, pod.Spec.NodeName)
		}
	}
}

func decodeAll(t *testing.T, file string, data []byte) []*unstructured.Unstructured {
	t.Helper()
	var out []*unstructured.Unstructured
	dec := utilyaml.NewYAMLOrJSONDecoder(strings.NewReader(string(data)), 4096)
	for {
		obj := &unstructured.Unstructured{}
		if err := dec.Decode(&obj.Object); err != nil {
			if err.Error() == "EOF" {
				return out
			}
			t.Fatalf("%s: %v", file, err)
		}
		if len(obj.Object) > 0 {
			out = append(out, obj)
		}
	}
}
