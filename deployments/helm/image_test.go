package helm

import (
	"os"
	"os/exec"
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

// TestBinariesAreBuiltWithoutGRPCTracing: the Makefile and the Dockerfile
// build with the same tags, grpcnotrace among them, and with those tags no
// long-running binary links golang.org/x/net/trace. That package's debug
// pages run html/template, whose reflective method calls make the linker keep
// every exported method of every type in the binary (the kubelet plugin: 80
// MB instead of 49, 14 MiB more resident); the kubelet plugin, whose memory
// every GPU node pays, links no template engine at all.
func TestBinariesAreBuiltWithoutGRPCTracing(t *testing.T) {
	tagsIn := func(file string, re *regexp.Regexp) string {
		t.Helper()
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		m := re.FindSubmatch(b)
		if m == nil {
			t.Fatalf("%s: no build tags found (want %s)", file, re)
		}
		return string(m[1])
	}
	makeTags := tagsIn("../../Makefile", regexp.MustCompile(`(?m)^export GOFLAGS .*-tags=([\w,]+)`))
	dockerTags := tagsIn("../../Dockerfile", regexp.MustCompile(`go build -tags=([\w,]+)`))
	if makeTags != dockerTags {
		t.Fatalf("the Makefile builds with tags %q, the Dockerfile with %q: the image would differ from what the tests ran", makeTags, dockerTags)
	}
	if !slices.Contains(strings.Split(makeTags, ","), "grpcnotrace") {
		t.Fatalf("build tags %q lack grpcnotrace", makeTags)
	}
	forbidden := map[string][]string{
		"tessera-kubelet-plugin": {"golang.org/x/net/trace", "html/template", "text/template"},
		"tessera-controller":     {"golang.org/x/net/trace"},
		"tessera-webhook":        {"golang.org/x/net/trace"},
	}
	for cmd, pkgs := range forbidden {
		list := exec.Command("go", "list", "-tags="+makeTags, "-deps", "./cmd/"+cmd)
		list.Dir = "../.."
		out, err := list.Output()
		if err != nil {
			t.Fatalf("go list %s: %v", cmd, err)
		}
		deps := strings.Fields(string(out))
		for _, p := range pkgs {
			if slices.Contains(deps, p) {
				t.Errorf("cmd/%s links %s (go list -deps -tags=%s): find what imports it and leave it out", cmd, p, makeTags)
			}
		}
	}
}
