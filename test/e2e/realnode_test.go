package e2e

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"maps"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/ptr"

	"github.com/tessera-dev/tessera/driver/fakenode"
	"github.com/tessera-dev/tessera/test/cluster"
)

// realNodeSteps runs the steps of a test on a real-runtime node; a failing
// step fails the test with its name and the tails of the node's containerd
// and kubelet logs.
type realNodeSteps struct {
	t    *testing.T
	node *cluster.Node
	// logs, if set, returns more components' log lines (e.g. a plugin
	// pod's container log), headed by their names.
	logs func() string
}

func (s realNodeSteps) fail(step string, format string, args ...any) {
	s.t.Helper()
	more := ""
	if s.logs != nil {
		more = s.logs()
	}
	s.t.Fatalf("step %q failed: %s\n==== last lines of %s\n%s\n==== last lines of %s\n%s\n%s", step, fmt.Sprintf(format, args...),
		s.node.ContainerdLog(), logTail(s.node.ContainerdLog(), 25), s.node.KubeletLog(), logTail(s.node.KubeletLog(), 25), more)
}

// run creates the pod and waits until its container has written a line
// "END"; it returns the running pod and the container's output before it.
// A container that ends first fails the step.
func (s realNodeSteps) run(ctx context.Context, c *tesseraCluster, step string, pod *corev1.Pod) (*corev1.Pod, string) {
	s.t.Helper()
	if _, err := c.Client().CoreV1().Pods(pod.Namespace).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		s.fail(step, "create pod %s/%s: %v", pod.Namespace, pod.Name, err)
	}
	return s.wait(ctx, c, step, pod)
}

// wait waits until pod, created already, runs and its container has written
// a line "END"; it returns the running pod and the container's output
// before it. A container that ends first fails the step.
func (s realNodeSteps) wait(ctx context.Context, c *tesseraCluster, step string, pod *corev1.Pod) (*corev1.Pod, string) {
	s.t.Helper()
	client := c.Client()
	var last *corev1.Pod
	deadline := time.Now().Add(2 * time.Minute)
	for {
		p, err := client.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
		if err == nil {
			last = p
			out, _ := s.node.ContainerLog(p.Namespace, p.Name, string(p.UID), p.Spec.Containers[0].Name)
			if before, _, found := strings.Cut(out, "END\n"); found && p.Status.Phase == corev1.PodRunning {
				return p, before
			}
			if p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
				s.fail(step, "pod %s/%s ended early: %+v\ncontainer output:\n%s\nevents:\n%s", p.Namespace, p.Name, p.Status, out, c.events(ctx, p.Namespace))
			}
		}
		if time.Now().After(deadline) {
			s.fail(step, "pod %s/%s did not run and write END within 2m; last status %+v\nevents:\n%s", pod.Namespace, pod.Name, last, c.events(ctx, pod.Namespace))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// logTail is the end of a component's log, for failure messages.
func logTail(path string, lines int) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(cannot read: %v)", err)
	}
	all := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	return strings.Join(all[max(0, len(all)-lines):], "\n")
}

// busyboxPod is a pod that runs script in the busybox image the
// real-runtime nodes hold, then writes END and waits to be deleted.
// The kubelet turns "$$" in a command into "$": scripts avoid it.
func busyboxPod(ns, name, node, script string) *corev1.Pod {
	return onNode(&corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: corev1.PodSpec{
			RestartPolicy:                 corev1.RestartPolicyNever,
			TerminationGracePeriodSeconds: ptr.To[int64](1),
			Containers: []corev1.Container{{
				Name:            "main",
				Image:           cluster.BusyboxImage,
				ImagePullPolicy: corev1.PullNever,
				Command:         []string{"sh", "-c", script + "\necho END\nexec sleep 3600"},
			}},
		},
	}, node)
}

// withClaim gives pod, a busyboxPod, a claim named name made from the
// ResourceClaimTemplate template, for its container.
func withClaim(pod *corev1.Pod, name, template string) *corev1.Pod {
	pod.Spec.ResourceClaims = []corev1.PodResourceClaim{{Name: name, ResourceClaimTemplateName: ptr.To(template)}}
	pod.Spec.Containers[0].Resources.Claims = []corev1.ResourceClaim{{Name: name}}
	return pod
}

// gpuProbe is what the GPU workload's container prints about itself: its
// NVIDIA device nodes (type, major and minor in hex), its environment, the
// driver library mounted in, what tessera-cdi-hook left in its root (the
// loader cache in base64, the libcuda.so link, the loader configuration),
// and how opening device nodes ends: the GPU node it was given, and one it
// makes itself with mknod for the first other minor number among 0-7 (the
// node's other GPUs). With no NVIDIA driver on the host, an open the
// devices cgroup allows fails with ENXIO ("No such device or address"); one
// it refuses fails with EPERM.
const gpuProbe = `for f in /dev/nvidia*; do stat -c 'DEV %n %F %t %T' "$f"; done
env | sed 's/^/ENV /'
echo "LIB $(cat /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1)"
echo "LDCACHE $(base64 /etc/ld.so.cache 2>/dev/null | tr -d '\n')"
echo "CUDALINK $(readlink /usr/lib/x86_64-linux-gnu/libcuda.so 2>&1)"
echo "LDCONF $(tr '\n' ' ' < /etc/ld.so.conf.d/000-tessera-driver.conf 2>&1)"
given=$(ls /dev/nvidia[0-9]*)
echo "OPEN-GIVEN $(cat $given 2>&1)"
for m in 0 1 2 3 4 5 6 7; do if [ /dev/nvidia$m != $given ]; then other=$m; break; fi; done
echo "OTHER-MINOR $other"
mknod /tmp/other c 195 $other
echo "OPEN-OTHER $(cat /tmp/other 2>&1)"
for f in $(find /var/run/kubernetes.io/dra-device-attributes -name '*-metadata.json' 2>/dev/null); do echo "META $f $(tr -d '\n' < "$f")"; done
`

// TestRealRuntimeNodeRunsContainersWithTheirGPUs runs pods in real
// containers: containerd 2 with runc on a node of the local cluster, with
// Tessera's kubelet plugin serving a simulated DGX H100 there. A busybox pod
// runs and its output comes back from the container's log; then a pod with
// a one-GPU claim sees, from inside its container, the device nodes of its
// GPU and of the driver's control devices as character devices with
// NVIDIA's numbers (containerd injected them from Tessera's CDI spec, runc
// created them), its GPU's UUID in NVIDIA_VISIBLE_DEVICES and
// TESSERA_GPU_<n>_UUID, the driver library, and the devices cgroup: it can
// open its GPU but not another one.
func TestRealRuntimeNodeRunsContainersWithTheirGPUs(t *testing.T) {
	t.Parallel()
	start := time.Now()
	c := startTessera(t, gpuNodeSpec{name: "real-1", profile: "dgx-h100", runtime: cluster.RealContainerd})
	t.Logf("cluster with a real-runtime node and Tessera's plugin up in %v", time.Since(start).Round(time.Millisecond))
	_, ctx := ktesting.NewTestContext(t)
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	n := c.nodes["real-1"]
	steps := realNodeSteps{t: t, node: n.Node.Node}
	const ns = "real"
	if err := c.CreateNamespace(ctx, ns); err != nil {
		t.Fatal(err)
	}

	step := "busybox pod runs under runc and its output is read back"
	t0 := time.Now()
	hello, out := steps.run(ctx, c, step, busyboxPod(ns, "hello", n.Name(),
		`echo "hello from $(hostname)"; echo "pid $(sh -c 'echo $PPID')"`))
	if !strings.Contains(out, "hello from hello\n") || !strings.Contains(out, "pid 1\n") {
		steps.fail(step, "container output %q lacks its greeting from hostname hello as PID 1 of its own PID namespace", out)
	}
	t.Logf("%s: %v", step, time.Since(t0).Round(time.Millisecond))

	checkNodeAddress(ctx, t, c, steps, ns, hello, "hello from hello\n")
	checkGPUPod(ctx, t, c, steps, ns, n.Name(), false)
	c.deletePodsAndWait(ctx, t, hello)
	t.Logf("test body took %v", time.Since(start).Round(time.Millisecond))
}

// checkNodeAddress checks a real-runtime node's own address (Node.IP): the
// Node has it, not a loopback address, as its one InternalIP; a hostNetwork
// pod there gets it as status.hostIP and status.podIP and, through the
// downward API, as $HOST_IP, and the kubelet's tcpSocket readiness probe
// reaches a server the pod binds to that address only, as an IMEX daemon
// binds to its node's, which a pod of the pod network reaches too; and the
// API server reaches the node's kubelet there for the log of running, whose
// container wrote logged.
func checkNodeAddress(ctx context.Context, t *testing.T, c *tesseraCluster, steps realNodeSteps, ns string, running *corev1.Pod, logged string) {
	t.Helper()
	client := c.Client()
	step := "the Node has the node's own address as its InternalIP"
	t0 := time.Now()
	want := steps.node.IP()
	node, err := client.CoreV1().Nodes().Get(ctx, steps.node.Name(), metav1.GetOptions{})
	if err != nil {
		steps.fail(step, "get Node: %v", err)
	}
	var internal []string
	for _, a := range node.Status.Addresses {
		if a.Type == corev1.NodeInternalIP {
			internal = append(internal, a.Address)
		}
	}
	if ip := net.ParseIP(want); ip == nil || ip.IsLoopback() || !slices.Equal(internal, []string{want}) {
		steps.fail(step, "Node %s has the addresses %v; want one InternalIP, the node's own non-loopback address %q", node.Name, node.Status.Addresses, want)
	}
	t.Logf("%s (%s): %v", step, want, time.Since(t0).Round(time.Millisecond))

	step = "a hostNetwork pod gets the node's address, and the kubelet probes a server bound to it"
	t0 = time.Now()
	ports, err := cluster.FreePorts(1)
	if err != nil {
		t.Fatal(err)
	}
	const page = "served-at-the-node-address"
	pod := busyboxPod(ns, "host-net", steps.node.Name(), fmt.Sprintf(`echo "HOSTIP $HOST_IP"
echo %s > /tmp/index.html
httpd -p "$HOST_IP:%d" -h /tmp`, page, ports[0]))
	pod.Spec.HostNetwork = true
	pod.Spec.Containers[0].Env = []corev1.EnvVar{{Name: "HOST_IP", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "status.hostIP"}}}}
	pod.Spec.Containers[0].ReadinessProbe = &corev1.Probe{
		ProbeHandler:  corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromInt32(int32(ports[0]))}},
		PeriodSeconds: 1,
	}
	pod, out := steps.run(ctx, c, step, pod)
	if !strings.Contains(out, "HOSTIP "+want+"\n") {
		steps.fail(step, "the container's $HOST_IP (status.hostIP) is not %s; it wrote:\n%s", want, out)
	}
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		got, err := client.CoreV1().Pods(ns).Get(ctx, pod.Name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		pod = got
		return slices.ContainsFunc(pod.Status.Conditions, func(c corev1.PodCondition) bool {
			return c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue
		}), nil
	})
	if err != nil {
		steps.fail(step, "pod %s/%s, serving on %s:%d, not Ready: %v; status %+v\nevents:\n%s", ns, pod.Name, want, ports[0], err, pod.Status, c.events(ctx, ns))
	}
	if pod.Status.HostIP != want || pod.Status.PodIP != want {
		steps.fail(step, "pod %s/%s has hostIP %q and podIP %q, want the node's address %s", ns, pod.Name, pod.Status.HostIP, pod.Status.PodIP, want)
	}
	reach, out := steps.run(ctx, c, step, busyboxPod(ns, "reach", steps.node.Name(),
		// busybox-static's wget crashes (SIGSEGV) here: nc asks.
		fmt.Sprintf(`echo "GOT $(printf 'GET / HTTP/1.0\r\n\r\n' | timeout 10 nc %s %d 2>&1 | tail -n 1)"`, want, ports[0])))
	if !strings.Contains(out, "GOT "+page+"\n") {
		steps.fail(step, "a pod of the pod network (%s) did not get the page served at %s:%d; it wrote:\n%s", reach.Status.PodIP, want, ports[0], out)
	}
	c.deletePodsAndWait(ctx, t, pod, reach)
	t.Logf("%s: %v", step, time.Since(t0).Round(time.Millisecond))

	step = "the API server reads a container's log from the kubelet at the node's address"
	t0 = time.Now()
	log, err := client.CoreV1().Pods(running.Namespace).GetLogs(running.Name, &corev1.PodLogOptions{}).DoRaw(ctx)
	if err != nil || !strings.Contains(string(log), logged) {
		steps.fail(step, "log of pod %s/%s through the API server: %v\n%s\nwant it to hold %q", running.Namespace, running.Name, err, log, logged)
	}
	t.Logf("%s: %v", step, time.Since(t0).Round(time.Millisecond))
}

// checkGPUPod runs a pod with a one-GPU claim in namespace ns on node, a
// real-runtime node with Tessera's plugin, and checks from inside its
// container that it sees the device nodes of its GPU and of the driver's
// control devices as character devices with NVIDIA's numbers (containerd
// injected them from Tessera's CDI spec, runc created them), its GPU's UUID
// in NVIDIA_VISIBLE_DEVICES and TESSERA_GPU_<n>_UUID, the driver library,
// and the devices cgroup: it can open its GPU but not another one. With
// hook (the node's CDI specs run tessera-cdi-hook, as the chart installs
// it), the busybox image, which has no loader directories of its own and
// keeps its configuration in /etc/ld.so.conf (a /usr/lib64 layout), shows
// libcuda.so.1 at the driver's path in its loader cache as glibc's ldconfig
// on the host reads it, a libcuda.so link, and the driver's directory in its
// loader configuration. Then it deletes the pod and waits until its claim is
// unprepared.
func checkGPUPod(ctx context.Context, t *testing.T, c *tesseraCluster, steps realNodeSteps, ns, node string, hook bool) {
	t.Helper()
	n := c.nodes[node]
	step := "GPU pod sees its devices, environment and driver files, and only its GPU"
	t0 := time.Now()
	if _, err := c.Client().ResourceV1().ResourceClaimTemplates(ns).Create(ctx, gpuTemplate(ns, "one-gpu", 1), metav1.CreateOptions{}); err != nil {
		steps.fail(step, "create claim template: %v", err)
	}
	pod := busyboxPod(ns, "gpu", n.Name(), gpuProbe)
	withClaim(pod, "gpu", "one-gpu")
	pod, out := steps.run(ctx, c, step, pod)
	got := parseProbe(out)
	claim := c.claimOf(ctx, t, pod, "gpu")
	devices := allocatedDevices(claim)
	if len(devices) != 1 {
		steps.fail(step, "claim %s allocated %v, want one GPU", claim.Name, devices)
	}
	g := n.gpuOf(t, devices[0])
	want := map[string]string{
		fmt.Sprintf("/dev/nvidia%d", g.minor): fmt.Sprintf("character special file %x %x", fakenode.NvidiaMajor, g.minor),
		"/dev/nvidiactl":                      fmt.Sprintf("character special file %x %x", fakenode.NvidiaMajor, 255),
		"/dev/nvidia-uvm":                     fmt.Sprintf("character special file %x %x", fakenode.UVMMajor, 0),
		"/dev/nvidia-uvm-tools":               fmt.Sprintf("character special file %x %x", fakenode.UVMMajor, 1),
	}
	if !maps.Equal(got.devices, want) {
		steps.fail(step, "container's NVIDIA device nodes (path: type major minor, hex) are %v, want %v\noutput:\n%s", got.devices, want, out)
	}
	if v := got.env["NVIDIA_VISIBLE_DEVICES"]; v != g.uuid {
		steps.fail(step, "NVIDIA_VISIBLE_DEVICES=%q, want %s (%s)\noutput:\n%s", v, g.uuid, devices[0], out)
	}
	key := "TESSERA_" + strings.ToUpper(strings.ReplaceAll(devices[0], "-", "_")) + "_UUID"
	if v := got.env[key]; v != g.uuid {
		steps.fail(step, "%s=%q, want %s\noutput:\n%s", key, v, g.uuid, out)
	}
	if !strings.HasPrefix(got.lib, "fake libnvidia-ml.so.") {
		steps.fail(step, "the driver library in the container reads %q, want the node's (fake libnvidia-ml.so.<version>)\noutput:\n%s", got.lib, out)
	}
	if hook {
		checkLoaderCache(t, steps, step, got, out)
	}
	checkDeviceMetadata(steps, step, claim, got, g.uuid, out)
	if !strings.Contains(got.openGiven, "No such device or address") {
		steps.fail(step, "opening its own GPU %s ended %q, want ENXIO (No such device or address: the devices cgroup allows it, no driver answers)\noutput:\n%s", devices[0], got.openGiven, out)
	}
	otherIsAGPU := false
	for i := range n.gpuCount(t) {
		if o := n.gpuOf(t, fmt.Sprintf("gpu-%d", i)); o.minor == got.otherMinor && o.minor != g.minor {
			otherIsAGPU = true
		}
	}
	if !otherIsAGPU {
		steps.fail(step, "the container tried minor %d as another GPU, which is no other GPU of node %s\noutput:\n%s", got.otherMinor, n.Name(), out)
	}
	if !strings.Contains(got.openOther, "Operation not permitted") {
		steps.fail(step, "opening another GPU's node ended %q, want EPERM (Operation not permitted: the devices cgroup refuses it)\noutput:\n%s", got.openOther, out)
	}
	t.Logf("%s: %v", step, time.Since(t0).Round(time.Millisecond))

	step = "deleted pods stop, their claim is unprepared"
	t0 = time.Now()
	c.deletePodsAndWait(ctx, t, pod)
	waitNoCDISpecs(ctx, t, n)
	t.Logf("%s: %v", step, time.Since(t0).Round(time.Millisecond))
}

// checkDeviceMetadata checks the device metadata file the container found
// (DeviceMetadata gate, on by default): one, where Kubernetes documents it
// for a claim from a template (the pod's claim "gpu"), naming the claim's
// one device with the UUID the test reads from the node's NVML.
func checkDeviceMetadata(steps realNodeSteps, step string, claim *resourceapi.ResourceClaim, got probeResult, uuid, out string) {
	want := "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpu/" + claim.Spec.Devices.Requests[0].Name + "/gpu.tessera.dev-metadata.json"
	content, ok := got.metadata[want]
	if !ok || len(got.metadata) != 1 {
		steps.fail(step, "the container's device metadata files are %v, want one, %s\noutput:\n%s", slices.Collect(maps.Keys(got.metadata)), want, out)
	}
	var doc struct {
		Requests []struct {
			Devices []struct {
				Name       string `json:"name"`
				Attributes map[string]struct {
					String *string `json:"string"`
				} `json:"attributes"`
			} `json:"devices"`
		} `json:"requests"`
	}
	if err := json.NewDecoder(strings.NewReader(content)).Decode(&doc); err != nil {
		steps.fail(step, "device metadata %s does not decode: %v\n%s", want, err, content)
	}
	if len(doc.Requests) != 1 || len(doc.Requests[0].Devices) != 1 {
		steps.fail(step, "device metadata %s holds %+v, want one request of one device", want, doc.Requests)
	}
	d := doc.Requests[0].Devices[0]
	if u := d.Attributes["uuid"].String; d.Name != allocatedDevices(claim)[0] || u == nil || *u != uuid {
		steps.fail(step, "device metadata %s names device %s with attributes %v, want %s with uuid %s\n%s", want, d.Name, d.Attributes, allocatedDevices(claim)[0], uuid, content)
	}
}

// probeResult is what gpuProbe printed.
type probeResult struct {
	devices              map[string]string // path -> "<type> <major hex> <minor hex>"
	metadata             map[string]string // device metadata file -> its content
	env                  map[string]string
	lib                  string
	ldCache              string // base64
	cudaLink, ldConf     string
	openGiven, openOther string
	otherMinor           int
}

func parseProbe(out string) probeResult {
	r := probeResult{devices: map[string]string{}, env: map[string]string{}, metadata: map[string]string{}}
	for _, line := range strings.Split(out, "\n") {
		tag, rest, _ := strings.Cut(line, " ")
		switch tag {
		case "DEV":
			path, desc, _ := strings.Cut(rest, " ")
			r.devices[path] = desc
		case "ENV":
			k, v, _ := strings.Cut(rest, "=")
			r.env[k] = v
		case "LIB":
			r.lib = rest
		case "LDCACHE":
			r.ldCache = rest
		case "CUDALINK":
			r.cudaLink = rest
		case "LDCONF":
			r.ldConf = rest
		case "OPEN-GIVEN":
			r.openGiven = rest
		case "OPEN-OTHER":
			r.openOther = rest
		case "OTHER-MINOR":
			r.otherMinor, _ = strconv.Atoi(rest)
		case "META":
			path, content, _ := strings.Cut(rest, " ")
			r.metadata[path] = content
		}
	}
	return r
}

// driverLibDir is where the simulated node's driver keeps its libraries,
// and the CDI specs mount them.
const driverLibDir = "/usr/lib/x86_64-linux-gnu"

// checkLoaderCache checks what tessera-cdi-hook left in the container, as
// gpuProbe printed it: glibc's own ldconfig on the host (the oracle: it
// shares no code with the hook's cache writer) lists libcuda.so.1 and
// libcuda.so at the driver's path for x86-64, libcuda.so links to
// libcuda.so.1, and the loader configuration names the driver's directory.
func checkLoaderCache(t *testing.T, steps realNodeSteps, step string, got probeResult, out string) {
	t.Helper()
	data, err := base64.StdEncoding.DecodeString(got.ldCache)
	if err != nil || len(data) == 0 {
		steps.fail(step, "the container has no loader cache (/etc/ld.so.cache) the hook wrote: %d bytes, %v\noutput:\n%s", len(data), err, out)
	}
	file := filepath.Join(t.TempDir(), "ld.so.cache")
	if err := os.WriteFile(file, data, 0o644); err != nil {
		t.Fatal(err)
	}
	printed, err := exec.Command("ldconfig", "-p", "-C", file).CombinedOutput()
	if err != nil {
		steps.fail(step, "glibc's ldconfig cannot read the container's loader cache: %v\n%s", err, printed)
	}
	for _, lib := range []string{"libcuda.so.1", "libcuda.so"} {
		want := fmt.Sprintf("%s (libc6,x86-64) => %s/%s", lib, driverLibDir, lib)
		if !slices.Contains(strings.Split(string(printed), "\n"), "\t"+want) {
			steps.fail(step, "the container's loader cache lacks %q; glibc's ldconfig -p reads:\n%s", want, printed)
		}
	}
	if got.cudaLink != "libcuda.so.1" {
		steps.fail(step, "%s/libcuda.so in the container links to %q, want libcuda.so.1\noutput:\n%s", driverLibDir, got.cudaLink, out)
	}
	if strings.TrimSpace(got.ldConf) != driverLibDir {
		steps.fail(step, "the hook's loader configuration in the container reads %q, want %s\noutput:\n%s", got.ldConf, driverLibDir, out)
	}
}

// migProbe is what a MIG workload's container prints about itself: its
// NVIDIA device nodes and MIG capability nodes (type, major and minor in
// hex), its environment, how opening each capability node ends, and how
// opening the capability node it makes itself for minor 2 ends (the MIG
// "monitor" capability, which no workload is given).
var migProbe = fmt.Sprintf(`for f in /dev/nvidia* /dev/nvidia-caps/*; do if [ -c "$f" ]; then stat -c 'DEV %%n %%F %%t %%T' "$f"; fi; done
env | sed 's/^/ENV /'
for f in /dev/nvidia-caps/*; do echo "OPEN-CAP $f $(cat $f 2>&1)"; done
mknod /tmp/monitor c %d 2
echo "OPEN-OTHER $(cat /tmp/monitor 2>&1)"
`, fakenode.CapsMajor)

// migMinors reads the capability minors of a node's host tree
// (/proc/driver/nvidia-caps/mig-minors, as the NVIDIA driver lays it out):
// minor number -> capability ("gpu3/gi2/access", "gpu3/gi2/ci0/access").
func migMinors(t *testing.T, hostRoot string) map[int]string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(hostRoot, "proc", "driver", "nvidia-caps", "mig-minors"))
	if err != nil {
		t.Fatal(err)
	}
	out := map[int]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(data)), "\n") {
		var name string
		var minor int
		if _, err := fmt.Sscanf(line, "%s %d", &name, &minor); err != nil {
			t.Fatalf("mig-minors line %q: %v", line, err)
		}
		out[minor] = name
	}
	return out
}

// checkMIGPod runs a pod with a claim for one partition of MIG profile in
// namespace ns on node, a real-runtime node with Tessera's plugin, and
// checks from inside its container that it sees its
// parent GPU's device node, the driver's control devices and exactly the
// two MIG capability nodes of its partition (the GPU instance's and the
// compute instance's access, as the node's mig-minors numbers them, of one
// GPU instance on the parent GPU) with the capabilities' major, its MIG
// UUID in NVIDIA_VISIBLE_DEVICES, and the devices cgroup: it can open its
// capability nodes but not the monitor capability. Then it deletes the pod
// and waits until its claim is unprepared.
func checkMIGPod(ctx context.Context, t *testing.T, c *tesseraCluster, steps realNodeSteps, ns, node, profile string) {
	t.Helper()
	n := c.nodes[node]
	step := "MIG pod sees its parent GPU and its partition's capability nodes, and only those"
	t0 := time.Now()
	template := migTemplate(ns, "one-1g", profile)
	if _, err := c.Client().ResourceV1().ResourceClaimTemplates(ns).Create(ctx, template, metav1.CreateOptions{}); err != nil {
		steps.fail(step, "create claim template: %v", err)
	}
	pod := busyboxPod(ns, "mig", n.Name(), migProbe)
	withClaim(pod, "mig", template.Name)
	pod, out := steps.run(ctx, c, step, pod)
	got := parseProbe(out)
	devices := allocatedDevices(c.claimOf(ctx, t, pod, "mig"))
	var parent int
	if len(devices) != 1 {
		steps.fail(step, "claim allocated %v, want one MIG device", devices)
	}
	if _, err := fmt.Sscanf(devices[0], "gpu-%d-mig-", &parent); err != nil {
		steps.fail(step, "allocated device %q is not a MIG device gpu-<parent>-mig-...", devices[0])
	}
	g := n.gpuOf(t, fmt.Sprintf("gpu-%d", parent))
	want := map[string]string{
		fmt.Sprintf("/dev/nvidia%d", g.minor): fmt.Sprintf("character special file %x %x", fakenode.NvidiaMajor, g.minor),
		"/dev/nvidiactl":                      fmt.Sprintf("character special file %x %x", fakenode.NvidiaMajor, 255),
		"/dev/nvidia-uvm":                     fmt.Sprintf("character special file %x %x", fakenode.UVMMajor, 0),
		"/dev/nvidia-uvm-tools":               fmt.Sprintf("character special file %x %x", fakenode.UVMMajor, 1),
	}
	minors := migMinors(t, n.Fake.HostRoot)
	var caps []string
	for p, desc := range got.devices {
		var minor int
		if _, err := fmt.Sscanf(p, "/dev/nvidia-caps/nvidia-cap%d", &minor); err != nil {
			continue
		}
		if desc != fmt.Sprintf("character special file %x %x", fakenode.CapsMajor, minor) {
			steps.fail(step, "capability node %s is %q, want a character device %d:%d\noutput:\n%s", p, desc, fakenode.CapsMajor, minor, out)
		}
		caps = append(caps, minors[minor])
		want[p] = desc
	}
	if !maps.Equal(got.devices, want) {
		steps.fail(step, "container's NVIDIA device nodes (path: type major minor, hex) are %v, want %v and two capability nodes\noutput:\n%s", got.devices, want, out)
	}
	slices.Sort(caps)
	var gi, ci int
	if len(caps) != 2 {
		steps.fail(step, "container has capability nodes for %q, want two\noutput:\n%s", caps, out)
	}
	if _, err := fmt.Sscanf(caps[0], fmt.Sprintf("gpu%d/gi%%d/access", g.minor), &gi); err != nil {
		steps.fail(step, "capability nodes %q: the first is no GPU instance access of GPU minor %d\noutput:\n%s", caps, g.minor, out)
	}
	if _, err := fmt.Sscanf(caps[1], fmt.Sprintf("gpu%d/gi%d/ci%%d/access", g.minor, gi), &ci); err != nil {
		steps.fail(step, "capability nodes %q: the second is no compute instance access of GPU instance %d on GPU minor %d\noutput:\n%s", caps, gi, g.minor, out)
	}
	if v := got.env["NVIDIA_VISIBLE_DEVICES"]; !strings.HasPrefix(v, "MIG-") || strings.Contains(v, ",") {
		steps.fail(step, "NVIDIA_VISIBLE_DEVICES=%q, want one MIG-<uuid>\noutput:\n%s", v, out)
	}
	opened := 0
	for _, line := range strings.Split(out, "\n") {
		if rest, ok := strings.CutPrefix(line, "OPEN-CAP "); ok {
			opened++
			if !strings.Contains(rest, "No such device or address") {
				steps.fail(step, "opening its capability node ended %q, want ENXIO (the devices cgroup allows it)\noutput:\n%s", rest, out)
			}
		}
	}
	if opened != 2 {
		steps.fail(step, "the container opened %d capability nodes, want 2\noutput:\n%s", opened, out)
	}
	if !strings.Contains(got.openOther, "Operation not permitted") {
		steps.fail(step, "opening the monitor capability ended %q, want EPERM (the devices cgroup refuses it)\noutput:\n%s", got.openOther, out)
	}
	t.Logf("%s: %s got GPU instance %d, compute instance %d of GPU %d, in %v", step, devices[0], gi, ci, parent, time.Since(t0).Round(time.Millisecond))

	step = "the deleted MIG pod stops, its claim is unprepared"
	t0 = time.Now()
	c.deletePodsAndWait(ctx, t, pod)
	waitNoCDISpecs(ctx, t, n)
	t.Logf("%s: %v", step, time.Since(t0).Round(time.Millisecond))
}
