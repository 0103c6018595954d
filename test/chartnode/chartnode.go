// Package chartnode runs Tessera as its chart installs it on the local
// cluster's real-runtime nodes (test/cluster): Tessera's image built
// without a container engine, the chart's values that make such a node a
// simulated GPU node, and the DaemonSet's plugin pod as it comes up. The
// end-to-end tests and `make demo` share it.
package chartnode

import (
	"context"
	"fmt"
	"maps"
	"path/filepath"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/tessera-dev/tessera/test/cluster"
	"github.com/tessera-dev/tessera/test/ociimage"
)

// GPUNodeLabel is the label the chart's default node selector asks for.
var GPUNodeLabel = map[string]string{"nvidia.com/gpu.present": "true"}

// NameLabel is the image label BuildImage sets to the image's name.
const NameLabel = "test.tessera.dev/image"

// PluginSelector selects the DaemonSet's plugin pods.
const PluginSelector = "app.kubernetes.io/component=kubelet-plugin"

// BuildImage builds Tessera's binaries and image as `make image-oci` does,
// from the module in moduleDir, and writes it under dir as an OCI archive
// holding it under each of names; it returns the archive's path. Each name
// gets an image of its own (the same files, its name in a label), so that
// a container's status names the image it runs: with one image under two
// names, the runtime may report either.
func BuildImage(ctx context.Context, moduleDir, dir string, names ...string) (string, error) {
	bin := filepath.Join(dir, "bin")
	if err := ociimage.BuildBinaries(ctx, moduleDir, bin); err != nil {
		return "", fmt.Errorf("build Tessera's binaries for its image: %w", err)
	}
	img, err := ociimage.Tessera(ociimage.DebDir(), bin)
	if err != nil {
		return "", fmt.Errorf("assemble Tessera's image: %w", err)
	}
	images := map[string]v1.Image{}
	for _, n := range names {
		cfg, err := img.ConfigFile()
		if err != nil {
			return "", fmt.Errorf("read the image's configuration: %w", err)
		}
		cfg = cfg.DeepCopy()
		cfg.Config.Labels = maps.Clone(cfg.Config.Labels)
		if cfg.Config.Labels == nil {
			cfg.Config.Labels = map[string]string{}
		}
		cfg.Config.Labels[NameLabel] = n
		if images[n], err = mutate.ConfigFile(img, cfg); err != nil {
			return "", fmt.Errorf("label image %s: %w", n, err)
		}
	}
	archive := filepath.Join(dir, "tessera.oci.tar")
	if err := ociimage.WriteArchive(archive, images); err != nil {
		return "", fmt.Errorf("write Tessera's image: %w", err)
	}
	return archive, nil
}

// ImageValues are the chart's image values for image (repository:tag),
// which the node holds already.
func ImageValues(image string) map[string]any {
	repository, tag, _ := strings.Cut(image, ":")
	return map[string]any{"repository": repository, "tag": tag, "pullPolicy": "Never"}
}

// Values are the chart's values that run the kubelet plugin from image on
// c's real-runtime nodes, simulating fakenode profile, and the gang
// controller on one of them. The kubelet and CDI dirs are the chart's
// defaults (a real-runtime node has them where a real node does), and the
// pods run in the pod network, as the chart's defaults have them. Since the
// local cluster runs no Service proxy, they reach the API server at the
// cluster's address for pods (cluster.PodAPIServer) in place of the
// kubernetes Service.
func Values(c *cluster.Cluster, image, profile string) (map[string]any, error) {
	host, port, ok := c.PodAPIServer()
	if !ok {
		return nil, fmt.Errorf("the cluster in %s has no real-runtime node for the chart's pods", c.Dir())
	}
	env := []any{
		map[string]any{"name": "KUBERNETES_SERVICE_HOST", "value": host},
		map[string]any{"name": "KUBERNETES_SERVICE_PORT", "value": port},
	}
	return map[string]any{
		"image": ImageValues(image),
		"kubeletPlugin": map[string]any{
			"fakeNode":     profile,
			"extraEnv":     env,
			"logVerbosity": 4,
		},
		"controller": map[string]any{
			"extraEnv":     env,
			"nodeSelector": RealRuntimeNodes,
			"logVerbosity": 4,
		},
	}, nil
}

// RealRuntimeNodes selects the cluster's real-runtime nodes, where a pod's
// containers really run.
var RealRuntimeNodes = map[string]any{cluster.RuntimeLabel: cluster.RealContainerdLabelValue}

// PluginPod returns the DaemonSet's plugin pod on node in namespace ns if
// it is the only one there, is not the pod with UID not (if set), runs
// image and is ready; otherwise nil and what it found instead.
func PluginPod(ctx context.Context, client kubernetes.Interface, ns, node, image string, not types.UID) (*corev1.Pod, string) {
	return OnlyReadyPod(ctx, client, ns, metav1.ListOptions{LabelSelector: PluginSelector, FieldSelector: "spec.nodeName=" + node}, "plugin pods on node "+node, image, not)
}

// OnlyReadyPod returns the one pod in ns that list selects (what names
// them in messages) if there is exactly one, it is not the pod with UID not
// (if set) nor being deleted, and its one container runs image and is
// ready; otherwise nil and what it found instead.
func OnlyReadyPod(ctx context.Context, client kubernetes.Interface, ns string, list metav1.ListOptions, what, image string, not types.UID) (*corev1.Pod, string) {
	pods, err := client.CoreV1().Pods(ns).List(ctx, list)
	switch {
	case err != nil:
		return nil, err.Error()
	case len(pods.Items) != 1:
		return nil, fmt.Sprintf("%d %s", len(pods.Items), what)
	}
	p := &pods.Items[0]
	switch {
	case not != "" && p.UID == not:
		return nil, fmt.Sprintf("pod %s is still the one that was there", p.Name)
	case p.DeletionTimestamp != nil || p.Status.Phase != corev1.PodRunning || len(p.Status.ContainerStatuses) != 1 || !p.Status.ContainerStatuses[0].Ready:
		return nil, fmt.Sprintf("pod %s: %s deleting=%v %+v", p.Name, p.Status.Phase, p.DeletionTimestamp != nil, p.Status.ContainerStatuses)
	case p.Status.ContainerStatuses[0].Image != image:
		return nil, fmt.Sprintf("pod %s runs image %q, want %q", p.Name, p.Status.ContainerStatuses[0].Image, image)
	}
	return p, ""
}
