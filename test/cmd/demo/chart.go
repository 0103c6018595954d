package main

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/utils/ptr"

	"github.com/tessera-dev/tessera/deployments/helm"
	"github.com/tessera-dev/tessera/test/chartnode"
	"github.com/tessera-dev/tessera/test/cluster"
	"github.com/tessera-dev/tessera/test/gpunode"
	"github.com/tessera-dev/tessera/test/helmrelease"
)

// The chart part of the demo: Tessera as users install it, on a real
// container runtime.
const (
	chartImage   = "tessera.test/tessera:demo"
	realNode     = "real-1"
	realProfile  = "dgx-h100"
	realPod      = "gpu-under-runc"
	realTemplate = "one-gpu"
)

// realProbe is what the demo's container prints about itself: its NVIDIA
// device nodes, its NVIDIA and Tessera environment, and the driver library
// mounted in with the loader cache entry tessera-cdi-hook made for it.
const realProbe = `ls -l /dev/nvidia* | sed 's/  */ /g'
env | grep -E '^(NVIDIA|TESSERA)_' | sort
echo "libcuda: $(readlink /usr/lib/x86_64-linux-gnu/libcuda.so), in the loader cache: $(grep -c libcuda.so.1 /etc/ld.so.cache) entry"
echo END
exec sleep 3600`

// runChart builds Tessera's image without a container engine, starts a
// second local cluster with one real-runtime node (containerd, runc),
// installs the Helm chart there with helm, runs a pod with a
// one-GPU claim under runc and prints what its container printed about
// itself, then uninstalls the chart and stops the cluster.
func runChart(ctx context.Context, dir string) error {
	start := time.Now()
	step("Building Tessera's image without a container engine (as make image-oci does)")
	archive, err := chartnode.BuildImage(ctx, ".", filepath.Join(dir, "image"), chartImage)
	if err != nil {
		return err
	}
	fmt.Printf("    %s in %v\n", chartImage, time.Since(start).Round(100*time.Millisecond))

	step("Starting a second local cluster with a real-runtime node %s (containerd, runc, a CNI bridge)", realNode)
	t0 := time.Now()
	c, err := cluster.Start(ctx, cluster.Options{Dir: filepath.Join(dir, "chart-cluster"), Nodes: []cluster.NodeSpec{{
		Name: realNode, Runtime: cluster.RealContainerd, Labels: chartnode.GPUNodeLabel,
	}}})
	if err != nil {
		return err
	}
	defer c.Stop()
	node := c.Node(realNode)
	if err := node.ImportImages(ctx, archive); err != nil {
		return err
	}
	fmt.Printf("    up in %v, the image imported into its containerd; kubectl: export KUBECONFIG=%s\n", time.Since(t0).Round(100*time.Millisecond), c.AdminKubeconfig())

	ns := helm.DefaultRelease.Namespace
	step("helm install %s deployments/helm/tessera -n %s --create-namespace (helm built from helm.sh/helm/v4), simulating a %s on %s", helm.DefaultRelease.Name, ns, realProfile, realNode)
	t0 = time.Now()
	values, err := chartnode.Values(c, chartImage, realProfile)
	if err != nil {
		return err
	}
	release, err := helmrelease.New(ctx, ".", filepath.Join(dir, "helm"), c.AdminKubeconfig(), ns)
	if err != nil {
		return err
	}
	if err := release.Install(ctx, helm.DefaultRelease.Name, values); err != nil {
		return err
	}
	client := c.Client()
	var plugin *corev1.Pod
	var last string
	if err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		plugin, last = chartnode.PluginPod(ctx, client, ns, realNode, chartImage, "")
		return plugin != nil, nil
	}); err != nil {
		return fmt.Errorf("the chart's plugin pod did not run on %s: %s", realNode, last)
	}
	ids, err := gpunode.WaitForSlices(ctx, client, realNode, 2*time.Minute)
	if err != nil {
		return err
	}
	fmt.Printf("    plugin pod %s runs under runc; it published %d ResourceSlices for %s in %v\n", plugin.Name, len(ids), realNode, time.Since(t0).Round(100*time.Millisecond))

	step("Running pod %s with a one-GPU claim under runc; its container prints:", realPod)
	t0 = time.Now()
	template := &resourceapi.ResourceClaimTemplate{
		ObjectMeta: metav1.ObjectMeta{Name: realTemplate, Namespace: namespace},
		Spec: resourceapi.ResourceClaimTemplateSpec{Spec: resourceapi.ResourceClaimSpec{
			Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
				Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: gpunode.DriverName},
			}}},
		}},
	}
	if _, err := client.ResourceV1().ResourceClaimTemplates(namespace).Create(ctx, template, metav1.CreateOptions{}); err != nil {
		return err
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: realPod, Namespace: namespace},
		Spec: corev1.PodSpec{
			// The scheduler allocates the claim: a pod bound with
			// spec.nodeName would skip it.
			NodeSelector:                  map[string]string{"kubernetes.io/hostname": realNode},
			RestartPolicy:                 corev1.RestartPolicyNever,
			TerminationGracePeriodSeconds: ptr.To[int64](1),
			ResourceClaims:                []corev1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: ptr.To(realTemplate)}},
			Containers: []corev1.Container{{
				Name: "main", Image: cluster.BusyboxImage, ImagePullPolicy: corev1.PullNever,
				Command:   []string{"sh", "-c", realProbe},
				Resources: corev1.ResourceRequirements{Claims: []corev1.ResourceClaim{{Name: "gpu"}}},
			}},
		},
	}
	if _, err := client.CoreV1().Pods(namespace).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		return err
	}
	var out string
	pod, err = waitForPod(ctx, client, realPod, 2*time.Minute, func(p *corev1.Pod) bool {
		out, _ = node.ContainerLog(p.Namespace, p.Name, string(p.UID), "main")
		return p.Status.Phase == corev1.PodRunning && strings.Contains(out, "END\n")
	})
	if err != nil {
		return fmt.Errorf("%w%s", err, eventsOf(ctx, c, realPod))
	}
	before, _, _ := strings.Cut(out, "END\n")
	for _, line := range strings.Split(strings.TrimRight(before, "\n"), "\n") {
		fmt.Printf("    | %s\n", line)
	}
	if !strings.Contains(before, "NVIDIA_VISIBLE_DEVICES=GPU-") {
		return fmt.Errorf("pod %s: its container got no GPU", realPod)
	}
	fmt.Printf("    on %s in %v\n", pod.Spec.NodeName, time.Since(t0).Round(100*time.Millisecond))

	step("Deleting the pod; helm uninstall %s", helm.DefaultRelease.Name)
	if err := client.CoreV1().Pods(namespace).Delete(ctx, realPod, metav1.DeleteOptions{}); err != nil {
		return err
	}
	if err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		_, err := client.CoreV1().Pods(namespace).Get(ctx, realPod, metav1.GetOptions{})
		return err != nil, nil
	}); err != nil {
		return fmt.Errorf("pod %s was not deleted: %w", realPod, err)
	}
	if err := release.Uninstall(ctx, helm.DefaultRelease.Name); err != nil {
		return err
	}
	fmt.Printf("    the chart part took %v\n", time.Since(start).Round(100*time.Millisecond))
	return nil
}

// eventsOf returns a pod's events in c, for error messages.
func eventsOf(ctx context.Context, c *cluster.Cluster, pod string) string {
	list, err := c.Client().CoreV1().Events(namespace).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + pod})
	if err != nil {
		return ""
	}
	var b strings.Builder
	for _, e := range list.Items {
		fmt.Fprintf(&b, "\n      event %s: %s", e.Reason, e.Message)
	}
	return b.String()
}
