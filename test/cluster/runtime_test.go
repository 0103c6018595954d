package cluster

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	"k8s.io/klog/v2/ktesting"
)

// cdiSpec is a CDI spec such as a DRA plugin writes for a claim. The device
// node is fully specified (type, major), so it need not exist on the host.
const cdiSpec = `cdiVersion: "0.6.0"
kind: gpu.tessera.dev/gpu
devices:
- name: claim-1-gpu-0
  containerEdits:
    env: ["NVIDIA_VISIBLE_DEVICES=GPU-0"]
    deviceNodes:
    - {path: /dev/nvidia0, type: c, major: 195, minor: 0}
containerEdits:
  mounts:
  - {hostPath: /tmp, containerPath: /usr/lib/tessera, options: [ro, bind]}
`

func startTestRuntime(t *testing.T) (runtimeapi.RuntimeServiceClient, *criRuntime, string) {
	t.Helper()
	_, ctx := ktesting.NewTestContext(t)
	dir := t.TempDir()
	cdiDir := filepath.Join(dir, "cdi")
	if err := os.MkdirAll(cdiDir, 0o755); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "cri.sock")
	r, err := startRuntime(ctx, sock, cdiDir, filepath.Join(dir, "var-log"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.stop)
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return runtimeapi.NewRuntimeServiceClient(conn), r, cdiDir
}

func containerRequest(name string, cdiDevices ...string) *runtimeapi.CreateContainerRequest {
	req := &runtimeapi.CreateContainerRequest{
		PodSandboxId: "sandbox-1",
		Config: &runtimeapi.ContainerConfig{
			Metadata: &runtimeapi.ContainerMetadata{Name: name},
			Image:    &runtimeapi.ImageSpec{Image: "registry.k8s.io/pause:3.10"},
			Envs:     []*runtimeapi.KeyValue{{Key: "FOO", Value: []byte("bar")}},
			Labels: map[string]string{
				"io.kubernetes.pod.namespace": "default",
				"io.kubernetes.pod.name":      "pod-1",
			},
		},
	}
	for _, d := range cdiDevices {
		req.Config.CDIDevices = append(req.Config.CDIDevices, &runtimeapi.CDIDevice{Name: d})
	}
	return req
}

func TestRuntimeInjectsCDIDevicesAndRecordsSpec(t *testing.T) {
	client, r, cdiDir := startTestRuntime(t)
	if err := os.WriteFile(filepath.Join(cdiDir, "claim-1.yaml"), []byte(cdiSpec), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := client.CreateContainer(t.Context(), containerRequest("main", "gpu.tessera.dev/gpu=claim-1-gpu-0")); err != nil {
		t.Fatalf("CreateContainer: %v", err)
	}
	got := r.recorded()
	if len(got) != 1 {
		t.Fatalf("recorded %d containers, want 1", len(got))
	}
	rc := got[0]
	if rc.PodName != "pod-1" || rc.Name != "main" {
		t.Errorf("recorded pod %q container %q, want pod-1 main", rc.PodName, rc.Name)
	}
	if env := rc.EnvMap(); env["NVIDIA_VISIBLE_DEVICES"] != "GPU-0" || env["FOO"] != "bar" {
		t.Errorf("env = %v, want NVIDIA_VISIBLE_DEVICES=GPU-0 and FOO=bar", rc.Spec.Process.Env)
	}
	if !slices.ContainsFunc(rc.Spec.Linux.Devices, func(d specs.LinuxDevice) bool { return d.Path == "/dev/nvidia0" && d.Major == 195 }) {
		t.Errorf("device nodes = %+v, want /dev/nvidia0 (195:0)", rc.Spec.Linux.Devices)
	}
	if !slices.ContainsFunc(rc.Spec.Mounts, func(m specs.Mount) bool { return m.Destination == "/usr/lib/tessera" }) {
		t.Errorf("mounts = %+v, want /usr/lib/tessera from the spec-wide edits", rc.Spec.Mounts)
	}
}

func TestRuntimeReadsCDIAnnotations(t *testing.T) {
	client, r, cdiDir := startTestRuntime(t)
	if err := os.WriteFile(filepath.Join(cdiDir, "claim-1.yaml"), []byte(cdiSpec), 0o644); err != nil {
		t.Fatal(err)
	}
	req := containerRequest("main")
	req.Config.Annotations = map[string]string{"cdi.k8s.io/claim-1": "gpu.tessera.dev/gpu=claim-1-gpu-0"}
	if _, err := client.CreateContainer(t.Context(), req); err != nil {
		t.Fatalf("CreateContainer: %v", err)
	}
	if got := r.recorded()[0].CDIDevices; !slices.Equal(got, []string{"gpu.tessera.dev/gpu=claim-1-gpu-0"}) {
		t.Errorf("CDI devices = %v, want the annotated one", got)
	}
}

func TestRuntimeFailsCreateContainerOnUnresolvableDevice(t *testing.T) {
	client, r, _ := startTestRuntime(t)
	_, err := client.CreateContainer(t.Context(), containerRequest("main", "gpu.tessera.dev/gpu=missing"))
	if err == nil || !strings.Contains(err.Error(), "unresolvable CDI devices gpu.tessera.dev/gpu=missing") {
		t.Fatalf("CreateContainer error = %v, want unresolvable CDI device", err)
	}
	if n := len(r.recorded()); n != 0 {
		t.Errorf("recorded %d containers after a failed create, want 0", n)
	}
}

// The kubelet deletes "<logPath>*" when it removes a container; an empty log
// path would make that every file in its working directory.
func TestRuntimeReportsContainerLogPath(t *testing.T) {
	client, r, _ := startTestRuntime(t)
	req := containerRequest("main")
	req.SandboxConfig = &runtimeapi.PodSandboxConfig{LogDirectory: "/var/log/pods/default_pod-1_uid-1"}
	req.Config.LogPath = "main/0.log"
	resp, err := client.CreateContainer(t.Context(), req)
	if err != nil {
		t.Fatalf("CreateContainer: %v", err)
	}
	st, err := client.ContainerStatus(t.Context(), &runtimeapi.ContainerStatusRequest{ContainerId: resp.GetContainerId()})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := st.GetStatus().GetLogPath(), "/var/log/pods/default_pod-1_uid-1/main/0.log"; got != want {
		t.Errorf("log path = %q, want %q", got, want)
	}
	if _, err := os.Stat(filepath.Join(r.varLogDir, "pods/default_pod-1_uid-1/main/0.log")); err != nil {
		t.Errorf("log file not created under the node's /var/log: %v", err)
	}
}

// TestDroppedRuntimeListsNothing: after a simulated reboot the kubelet finds
// no sandbox and no container, and nothing is recorded any more.
func TestDroppedRuntimeListsNothing(t *testing.T) {
	client, r, _ := startTestRuntime(t)
	ctx := t.Context()
	sandbox, err := client.RunPodSandbox(ctx, &runtimeapi.RunPodSandboxRequest{Config: &runtimeapi.PodSandboxConfig{
		Metadata: &runtimeapi.PodSandboxMetadata{Name: "pod-1", Namespace: "default", Uid: "uid-1"},
	}})
	if err != nil {
		t.Fatal(err)
	}
	req := containerRequest("main")
	req.PodSandboxId = sandbox.PodSandboxId
	if _, err := client.CreateContainer(ctx, req); err != nil {
		t.Fatal(err)
	}
	r.dropAll()
	sandboxes, err := client.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{})
	if err != nil {
		t.Fatal(err)
	}
	containers, err := client.ListContainers(ctx, &runtimeapi.ListContainersRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(sandboxes.Items) != 0 || len(containers.Containers) != 0 || len(r.recorded()) != 0 {
		t.Errorf("after the drop the runtime lists %d sandboxes, %d containers and recorded %d, want none",
			len(sandboxes.Items), len(containers.Containers), len(r.recorded()))
	}
}
