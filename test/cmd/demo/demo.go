package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"

	"github.com/tessera-dev/tessera/test/cluster"
	"github.com/tessera-dev/tessera/test/gpunode"
)

// nodes are the simulated GPU nodes, with their fakenode profiles.
var nodes = []struct{ name, profile string }{
	{"dgx-h100-1", "dgx-h100"},
	{"l4-server-1", "pcie-l4x4"},
}

// workload is one example from deployments/examples: the pod it creates and
// whether it must run.
type workload struct {
	file, pod, what string
	fits            bool
}

var workloads = []workload{
	{"single-gpu.yaml", "single-gpu", "one GPU, any model", true},
	{"nvlink-four-gpus.yaml", "nvlink-four-gpus", "four GPUs on one NVLink island (matchAttribute gpu.tessera.dev/nvlinkDomain)", true},
	{"gpu-by-product.yaml", "gpu-by-product", `one GPU by product name ("NVIDIA L4")`, true},
	{"mig/one-1g.yaml", "mig-1g", "one 1g.10gb MIG partition, created when the pod starts", true},
	{"too-many-gpus.yaml", "too-many-gpus", "nine GPUs on one node: no node has that many", false},
}

// namespace is where the examples go: they name none.
const namespace = metav1.NamespaceDefault

type demo struct {
	examples string
	c        *cluster.Cluster
	nodes    map[string]*gpunode.Node
	// devices describes every published device, by pool and device name.
	devices map[string]string
}

func step(format string, args ...any) {
	fmt.Printf("==> "+format+"\n", args...)
}

func (d *demo) setUp(ctx context.Context, dir string) error {
	start := time.Now()
	opts := cluster.Options{Dir: dir}
	var names []string
	for _, n := range nodes {
		opts.Nodes = append(opts.Nodes, cluster.NodeSpec{Name: n.name})
		names = append(names, fmt.Sprintf("%s (%s)", n.name, n.profile))
	}
	step("Starting a local cluster in %s with nodes %s", dir, strings.Join(names, ", "))
	c, err := cluster.Start(ctx, opts)
	if err != nil {
		return err
	}
	d.c = c
	fmt.Printf("    up in %v; kubectl: export KUBECONFIG=%s\n", time.Since(start).Round(100*time.Millisecond), c.AdminKubeconfig())

	step("Installing the DeviceClasses (deviceclass/) and the kubelet plugin's RBAC (deployments/rbac/)")
	if err := gpunode.Install(ctx, c); err != nil {
		return err
	}
	client, err := gpunode.PluginClient(ctx, c)
	if err != nil {
		return err
	}

	step("Starting Tessera's kubelet plugin on each node (in-process, as service account tessera-system/tessera-kubelet-plugin)")
	d.nodes = map[string]*gpunode.Node{}
	for _, spec := range nodes {
		n, err := gpunode.New(ctx, c.Node(spec.name), spec.profile, filepath.Join(dir, "fake-gpus", spec.name), client)
		if err != nil {
			return err
		}
		d.nodes[spec.name] = n
		if err := n.StartPlugin(); err != nil {
			return err
		}
	}
	for _, spec := range nodes {
		if _, err := gpunode.WaitForSlices(ctx, c.Client(), spec.name, time.Minute); err != nil {
			return err
		}
	}
	return d.describeSlices(ctx)
}

// describeSlices prints what each node publishes and remembers each device's
// description.
func (d *demo) describeSlices(ctx context.Context) error {
	list, err := d.c.Client().ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: "spec.driver=" + gpunode.DriverName})
	if err != nil {
		return fmt.Errorf("list ResourceSlices: %w", err)
	}
	d.devices = map[string]string{}
	type count struct{ slices, gpus, migs int }
	counts := map[string]*count{}
	products := map[string]string{}
	for _, s := range list.Items {
		pool := s.Spec.Pool.Name
		if counts[pool] == nil {
			counts[pool] = &count{}
		}
		counts[pool].slices++
		for _, dev := range s.Spec.Devices {
			d.devices[pool+"/"+dev.Name] = describe(dev)
			switch str(dev, "type") {
			case "gpu":
				counts[pool].gpus++
				products[pool] = str(dev, "productName")
			case "mig":
				counts[pool].migs++
			}
		}
	}
	for _, n := range nodes {
		c := counts[n.name]
		if c == nil || c.gpus == 0 {
			return fmt.Errorf("node %s published no GPUs", n.name)
		}
		fmt.Printf("    %-12s %d ResourceSlices: %d GPUs (%s), %d MIG placements\n", n.name, c.slices, c.gpus, products[n.name], c.migs)
	}
	return nil
}

func str(dev resourceapi.Device, attr resourceapi.QualifiedName) string {
	if a, ok := dev.Attributes[attr]; ok && a.StringValue != nil {
		return *a.StringValue
	}
	return ""
}

func describe(dev resourceapi.Device) string {
	parts := []string{str(dev, "productName")}
	if p := str(dev, "profile"); p != "" {
		parts = append(parts, "MIG "+p)
	}
	if dom := str(dev, "nvlinkDomain"); dom != "" && str(dev, "type") == "gpu" {
		parts = append(parts, "nvlinkDomain "+shorten(dom))
	}
	return strings.Join(parts, ", ")
}

func shorten(id string) string {
	if len(id) > 16 {
		return id[:16] + "…"
	}
	return id
}

func (d *demo) runWorkloads(ctx context.Context) error {
	step("Applying the examples from %s", d.examples)
	for _, w := range workloads {
		data, err := os.ReadFile(filepath.Join(d.examples, w.file))
		if err != nil {
			return fmt.Errorf("read example: %w", err)
		}
		if err := d.c.Apply(ctx, data); err != nil {
			return fmt.Errorf("apply %s: %w", w.file, err)
		}
		fmt.Printf("    %s\n", filepath.Join(d.examples, w.file))
	}
	var failed []string
	for _, w := range workloads {
		if ctx.Err() != nil {
			return context.Cause(ctx)
		}
		fmt.Printf("\n--- %s: %s (%s)\n", w.pod, w.what, w.file)
		var err error
		if w.fits {
			err = d.showRunning(ctx, w)
		} else {
			err = d.showPending(ctx, w)
		}
		if err != nil {
			fmt.Printf("    FAILED: %v\n", err)
			failed = append(failed, w.pod)
		}
	}
	if len(failed) > 0 {
		return fmt.Errorf("workloads not as expected: %s", strings.Join(failed, ", "))
	}
	return nil
}

var (
	gpuNode = regexp.MustCompile(`^/dev/nvidia[0-9]+$`)
	capNode = regexp.MustCompile(`^/dev/nvidia-caps/`)
)

func (d *demo) showRunning(ctx context.Context, w workload) error {
	client := d.c.Client()
	pod, err := waitForPod(ctx, client, w.pod, 2*time.Minute, func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodRunning })
	if err != nil {
		return fmt.Errorf("%w%s", err, d.events(ctx, w.pod))
	}
	fmt.Printf("    pod:        Running on node %s\n", pod.Spec.NodeName)
	if len(pod.Status.ResourceClaimStatuses) != 1 || pod.Status.ResourceClaimStatuses[0].ResourceClaimName == nil {
		return fmt.Errorf("pod %s: want one generated claim, got %+v", pod.Name, pod.Status.ResourceClaimStatuses)
	}
	claimName := *pod.Status.ResourceClaimStatuses[0].ResourceClaimName
	claim, err := client.ResourceV1().ResourceClaims(namespace).Get(ctx, claimName, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("get claim %s: %w", claimName, err)
	}
	if claim.Status.Allocation == nil {
		return fmt.Errorf("claim %s of running pod %s is not allocated", claimName, pod.Name)
	}
	fmt.Printf("    claim:      %s/%s\n", namespace, claimName)
	results := claim.Status.Allocation.Devices.Results
	for i, r := range results {
		label := "allocated:"
		if i > 0 {
			label = ""
		}
		fmt.Printf("    %-11s %s/%s (%s)\n", label, r.Pool, r.Device, d.devices[r.Pool+"/"+r.Device])
	}

	node := d.nodes[pod.Spec.NodeName]
	var rc *cluster.RecordedContainer
	for _, c := range node.Containers() {
		if c.PodUID == string(pod.UID) {
			rc = &c
		}
	}
	if rc == nil {
		return fmt.Errorf("the runtime of %s recorded no container of pod %s", node.Name(), pod.Name)
	}
	fmt.Printf("    prepared:   CDI devices %s\n", strings.Join(rc.CDIDevices, " "))
	specs, _ := filepath.Glob(filepath.Join(node.CDIDir(), "*"+string(claim.UID)+"*.json"))
	for _, s := range specs {
		fmt.Printf("                spec file %s\n", s)
	}
	var gpus, caps, other []string
	for _, dev := range rc.Spec.Linux.Devices {
		switch {
		case gpuNode.MatchString(dev.Path):
			gpus = append(gpus, dev.Path)
		case capNode.MatchString(dev.Path):
			caps = append(caps, dev.Path)
		default:
			other = append(other, dev.Path)
		}
	}
	sort.Strings(gpus)
	fmt.Printf("    container:  GPU device nodes %s\n", strings.Join(gpus, " "))
	if len(caps) > 0 {
		fmt.Printf("                MIG capability nodes %s\n", strings.Join(caps, " "))
	}
	fmt.Printf("                control nodes %s\n", strings.Join(other, " "))
	visible := rc.EnvMap()["NVIDIA_VISIBLE_DEVICES"]
	fmt.Printf("                NVIDIA_VISIBLE_DEVICES=%s\n", visible)
	var driverFiles []string
	for _, m := range rc.Spec.Mounts {
		if strings.Contains(m.Destination, "nvidia") || strings.Contains(m.Destination, "libcuda") {
			driverFiles = append(driverFiles, filepath.Base(m.Destination))
		}
	}
	fmt.Printf("                driver files %s\n", strings.Join(driverFiles, " "))

	if len(rc.CDIDevices) == 0 || visible == "" || len(gpus) == 0 {
		return fmt.Errorf("pod %s: container got no GPU (CDI devices %v, NVIDIA_VISIBLE_DEVICES %q, device nodes %v)", pod.Name, rc.CDIDevices, visible, gpus)
	}
	if n := len(strings.Split(visible, ",")); n != len(results) {
		return fmt.Errorf("pod %s: %d devices allocated but %d visible to the container", pod.Name, len(results), n)
	}
	return nil
}

func (d *demo) showPending(ctx context.Context, w workload) error {
	pod, err := waitForPod(ctx, d.c.Client(), w.pod, time.Minute, func(p *corev1.Pod) bool {
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && c.Reason == corev1.PodReasonUnschedulable {
				return true
			}
		}
		return false
	})
	if err != nil {
		return err
	}
	if pod.Spec.NodeName != "" {
		return fmt.Errorf("pod %s was bound to %s, want it unschedulable", pod.Name, pod.Spec.NodeName)
	}
	fmt.Printf("    pod:        %s, not scheduled\n", pod.Status.Phase)
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodScheduled {
			fmt.Printf("    scheduler:  %s: %s\n", c.Reason, c.Message)
		}
	}
	return nil
}

// events returns a pod's events, for error messages.
func (d *demo) events(ctx context.Context, pod string) string { return eventsOf(ctx, d.c, pod) }

func waitForPod(ctx context.Context, client kubernetes.Interface, name string, timeout time.Duration, done func(*corev1.Pod) bool) (*corev1.Pod, error) {
	var pod *corev1.Pod
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		p, err := client.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		pod = p
		return done(p), nil
	})
	if err != nil {
		status := "never created"
		if pod != nil {
			status = fmt.Sprintf("%s %+v", pod.Status.Phase, pod.Status.Conditions)
		}
		return nil, fmt.Errorf("pod %s: %w (last status: %s)", name, err, status)
	}
	return pod, nil
}

// cleanUp deletes the example pods and checks that every claim was
// unprepared: no CDI spec left, no MIG instance left.
func (d *demo) cleanUp(ctx context.Context) error {
	step("Deleting the example pods")
	client := d.c.Client()
	for _, w := range workloads {
		if err := client.CoreV1().Pods(namespace).Delete(ctx, w.pod, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete pod %s: %w", w.pod, err)
		}
	}
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		pods, err := client.CoreV1().Pods(namespace).List(ctx, metav1.ListOptions{})
		if err != nil || len(pods.Items) > 0 {
			return false, nil
		}
		for _, n := range d.nodes {
			if specs, _ := filepath.Glob(filepath.Join(n.CDIDir(), "*.json")); len(specs) > 0 || instances(n) > 0 {
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		return fmt.Errorf("pods not gone or claims not unprepared (CDI specs or MIG instances left): %w", err)
	}
	fmt.Println("    every claim unprepared: no CDI spec left on any node, MIG instances destroyed")
	return nil
}

func instances(n *gpunode.Node) int {
	total := 0
	for i := range n.Fake.Profile.GPUs {
		total += n.Fake.GPUInstances(i)
	}
	return total
}

// teardown stops the plugins and the cluster; safe after a partial setUp.
func (d *demo) teardown() {
	if d.c == nil {
		return
	}
	step("Tearing down")
	for _, n := range d.nodes {
		n.StopPlugin()
	}
	d.c.Stop()
	d.c = nil
	klog.Flush()
}
