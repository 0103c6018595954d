package e2e

import (
	"context"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/dynamic-resource-allocation/deviceattribute"
	"k8s.io/utils/ptr"

	"github.com/tessera-dev/tessera/driver/plugin"
	gpuslices "github.com/tessera-dev/tessera/driver/slices"
)

// examplesDir holds the workloads operators copy.
const examplesDir = "../../deployments/examples"

// pendingExamples are the example pods meant not to fit anywhere.
var pendingExamples = map[string]bool{"too-many-gpus": true}

// gangExamples and podGroupExamples need tessera-controller and GB200
// trays: TestGangExamplesRunOnTheLocalCluster applies them.
const (
	gangExamples     = "gang"
	podGroupExamples = "podgroup"
)

// nicDriver stands in for a NIC's DRA driver (and its DeviceClass) in the
// GPU-next-to-NIC example.
const nicDriver = "nic.example.com"

// TestEveryExampleRunsOnTheLocalCluster applies every file of
// deployments/examples (but the gangs'), as a user would, on nodes that have
// what the examples ask for: two DGX H100s (MIG, NVLink, power caps), the
// first also with a NIC driver's devices on each of its PCIe roots, and an
// L4 server whose GPU 0 is cut into four time slices and GPU 1 is shared by
// memory, every plugin with MPS enabled (as the chart's default image does).
// Every pod they create runs, except the one written not to fit, which the
// scheduler leaves Unschedulable.
func TestEveryExampleRunsOnTheLocalCluster(t *testing.T) {
	t.Parallel()
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

	nicRoots := startNICDriver(ctx, t, tc, "dgx-1")

	var files []string
	err := filepath.WalkDir(examplesDir, func(path string, d fs.DirEntry, err error) error {
		if err == nil && d.IsDir() && (d.Name() == gangExamples || d.Name() == podGroupExamples) {
			return filepath.SkipDir
		}
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
		data := applyFile(ctx, t, tc, f)
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
		if name == "gpu-next-to-nic" {
			checkGPUNextToNIC(ctx, t, tc, pod, nicRoots)
		}
	}
}

// startNICDriver runs a stand-in NIC driver on node with one NIC on each
// PCIe root that holds a Tessera GPU there, each NIC publishing its root as
// resource.kubernetes.io/pcieRoot as NIC drivers do, and installs its
// DeviceClass. It returns the PCIe root of every NIC.
func startNICDriver(ctx context.Context, t *testing.T, tc *tesseraCluster, node string) map[string]string {
	t.Helper()
	roots := map[string]string{}
	var nics []resourceapi.Device
	for _, root := range slices.Compact(slices.Sorted(maps.Values(gpuPCIeRoots(ctx, t, tc, node)))) {
		name := fmt.Sprintf("nic-%d", len(nics))
		roots[name] = root
		nics = append(nics, resourceapi.Device{Name: name, Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
			deviceattribute.StandardDeviceAttributePCIeRoot: {StringValue: ptr.To(root)},
		}})
	}
	if len(nics) < 2 {
		t.Fatalf("node %s: GPUs on %d PCIe roots, want several for the NIC example to mean something", node, len(nics))
	}
	class := &resourceapi.DeviceClass{
		ObjectMeta: metav1.ObjectMeta{Name: nicDriver},
		Spec: resourceapi.DeviceClassSpec{Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{
			Expression: fmt.Sprintf("device.driver == %q", nicDriver)}}}},
	}
	if _, err := tc.Client().ResourceV1().DeviceClasses().Create(ctx, class, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	helper, err := startStubDriver(ctx, tc.Node(node), tc.Client(), nicDriver, nics)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(helper.Stop)
	return roots
}

// gpuPCIeRoots maps each whole GPU Tessera publishes on node to its PCIe root.
func gpuPCIeRoots(ctx context.Context, t *testing.T, tc *tesseraCluster, node string) map[string]string {
	t.Helper()
	list, err := tc.Client().ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: "spec.driver=" + gpuslices.DriverName + ",spec.nodeName=" + node})
	if err != nil {
		t.Fatal(err)
	}
	roots := map[string]string{}
	for _, s := range list.Items {
		for _, d := range s.Spec.Devices {
			root := d.Attributes[deviceattribute.StandardDeviceAttributePCIeRoot].StringValue
			if d.Attributes[gpuslices.AttrType].StringValue != nil && *d.Attributes[gpuslices.AttrType].StringValue == gpuslices.TypeGPU && root != nil {
				roots[d.Name] = *root
			}
		}
	}
	return roots
}

// checkGPUNextToNIC checks that the pod got one GPU and one NIC under the
// same PCIe root, and that its container sees both.
func checkGPUNextToNIC(ctx context.Context, t *testing.T, tc *tesseraCluster, pod *corev1.Pod, nicRoots map[string]string) {
	t.Helper()
	claim := tc.claimOf(ctx, t, pod, "gpu-and-nic")
	gpuRoots := gpuPCIeRoots(ctx, t, tc, pod.Spec.NodeName)
	var gpuRoot, nicRoot, nic string
	for _, r := range claim.Status.Allocation.Devices.Results {
		switch r.Driver {
		case gpuslices.DriverName:
			gpuRoot = gpuRoots[r.Device]
		case nicDriver:
			nic, nicRoot = r.Device, nicRoots[r.Device]
		}
	}
	if gpuRoot == "" || nicRoot == "" || gpuRoot != nicRoot {
		t.Errorf("gpu-next-to-nic: allocated %+v: GPU on PCIe root %q, NIC %q on %q, want one of each on the same root", claim.Status.Allocation.Devices.Results, gpuRoot, nic, nicRoot)
	}
	if env := tc.containerOf(t, pod).EnvMap(); env["STUB_DEVICE"] != nic {
		t.Errorf("gpu-next-to-nic: container sees NIC %q, want %q", env["STUB_DEVICE"], nic)
	}
	t.Logf("gpu-next-to-nic: GPU and %s share PCIe root %s on %s", nic, gpuRoot, pod.Spec.NodeName)
}

// applyFile applies a manifest file as a user would and returns its
// content.
func applyFile(ctx context.Context, t *testing.T, tc *tesseraCluster, file string) []byte {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	if err := tc.Apply(ctx, data); err != nil {
		t.Fatalf("apply %s: %v", file, err)
	}
	return data
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
