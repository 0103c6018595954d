package helm

import (
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
)

// TestImageHoldsEveryBinaryTheChartRuns: the Dockerfile builds every
// command under cmd/, and every container the chart runs from the Tessera
// image starts one of them (a binary missing from the image fails only on a
// real cluster, at the pod's start).
func TestImageHoldsEveryBinaryTheChartRuns(t *testing.T) {
	dockerfile, err := os.ReadFile("../../Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	var built []string
	for _, m := range regexp.MustCompile(`\./cmd/([a-z0-9-]+)`).FindAllStringSubmatch(string(dockerfile), -1) {
		built = append(built, m[1])
	}
	entries, err := os.ReadDir("../../cmd")
	if err != nil {
		t.Fatal(err)
	}
	var commands []string
	for _, e := range entries {
		if e.IsDir() {
			commands = append(commands, e.Name())
		}
	}
	slices.Sort(built)
	if !slices.Equal(built, commands) {
		t.Fatalf("the Dockerfile builds %v, want every command under cmd/: %v", built, commands)
	}
	for _, c := range Combinations() {
		r := renderT(t, c)
		var pods []corev1.PodSpec
		for _, d := range find[*appsv1.Deployment](r) {
			pods = append(pods, d.Spec.Template.Spec)
		}
		for _, ds := range find[*appsv1.DaemonSet](r) {
			pods = append(pods, ds.Spec.Template.Spec)
		}
		if len(pods) == 0 {
			t.Fatalf("%s: no workloads rendered", c.Name)
		}
		for _, pod := range pods {
			for _, ctr := range append(pod.InitContainers, pod.Containers...) {
				if !strings.Contains(ctr.Image, "tessera") {
					continue
				}
				if len(ctr.Command) == 0 || !slices.Contains(built, ctr.Command[0]) {
					t.Errorf("%s: container %s runs %v from %s, which the image does not hold (it has %v)", c.Name, ctr.Name, ctr.Command, ctr.Image, built)
				}
			}
		}
	}
}
