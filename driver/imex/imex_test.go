package imex_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/driver/daemonpod"
	"github.com/tessera-dev/tessera/driver/imex"
	"github.com/tessera-dev/tessera/driver/prepare"
)

// kubelet plays the node's kubelet for the fake client: every pod created
// gets the status st gives it (a ready daemon, a crashing one). It counts
// the creations.
func kubelet(client *fake.Clientset, st func(*corev1.Pod)) *int {
	n := new(int)
	client.PrependReactor("create", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		*n++
		st(a.(k8stesting.CreateAction).GetObject().(*corev1.Pod))
		return false, nil, nil // the tracker stores the pod with its status
	})
	return n
}

func ready(p *corev1.Pod) {
	p.Status.Phase = corev1.PodRunning
	p.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}
	p.Status.ContainerStatuses = []corev1.ContainerStatus{{Name: "imex-daemon", Ready: true, State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}}}
}

func daemons(client *fake.Clientset, dir string) *imex.Daemons {
	return &imex.Daemons{Host: daemonpod.Host{Client: client, Namespace: "tessera-system", NodeName: "tray-2", Image: "registry.example/tessera:v1", Dir: dir, DriverRoot: "/run/nvidia/driver", ReadyTimeout: 2 * time.Second}}
}

func gang(d *imex.Daemons, nodes ...gangv1.Node) prepare.IMEXDaemon {
	return prepare.IMEXDaemon{Daemon: d.Locate("uid-1"), ClaimUID: "uid-1", ClaimNamespace: "ml", ClaimName: "train-domain", Nodes: nodes}
}

// newClient is a fake API holding three trays, each with its InternalIP.
func newClient() *fake.Clientset {
	var objs []runtime.Object
	for i := 1; i <= 3; i++ {
		objs = append(objs, &corev1.Node{
			ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("tray-%d", i)},
			Status:     corev1.NodeStatus{Addresses: []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: fmt.Sprintf("10.0.0.%d", i)}}},
		})
	}
	return fake.NewClientset(objs...)
}

var trays = []gangv1.Node{{Name: "tray-1", Address: "10.0.0.1"}, {Name: "tray-2", Address: "10.0.0.2"}}

func TestTheDaemonGetsExactlyTheGangsNodesAndRunsOnItsNode(t *testing.T) {
	ctx := context.Background()
	client := newClient()
	kubelet(client, ready)
	d := daemons(client, t.TempDir())
	daemon := gang(d, trays...)
	if err := d.Start(ctx, daemon); err != nil {
		t.Fatal(err)
	}
	nodes, err := os.ReadFile(filepath.Join(daemon.Dir, imex.NodesConfigFile))
	if err != nil {
		t.Fatal(err)
	}
	if string(nodes) != "10.0.0.1\n10.0.0.2\n" {
		t.Errorf("nodes configuration %q, want the gang's two addresses", nodes)
	}
	config, err := os.ReadFile(filepath.Join(daemon.Dir, imex.ConfigFile))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range []string{"DAEMONIZE=0", "SERVER_PORT=50000", "BIND_INTERFACE_IP=10.0.0.2", "IMEX_NODE_CONFIG_FILE=/etc/nvidia-imex/nodes_config.cfg"} {
		if !strings.Contains(string(config), "\n"+line+"\n") {
			t.Errorf("configuration lacks %s:\n%s", line, config)
		}
	}
	pod, err := client.CoreV1().Pods("tessera-system").Get(ctx, daemon.Pod, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	c := pod.Spec.Containers[0]
	switch {
	case pod.Spec.NodeName != "tray-2" || !pod.Spec.HostNetwork:
		t.Errorf("pod on node %q, host network %v; want tray-2, true", pod.Spec.NodeName, pod.Spec.HostNetwork)
	case strings.Join(c.Command, " ") != "/driver-root/usr/bin/nvidia-imex -c /etc/nvidia-imex/config.cfg":
		t.Errorf("command %v", c.Command)
	case c.ReadinessProbe == nil || c.ReadinessProbe.TCPSocket == nil || c.ReadinessProbe.TCPSocket.Port.IntValue() != 50000:
		t.Errorf("readiness probe %+v, want a TCP probe of port 50000", c.ReadinessProbe)
	case len(c.Ports) != 1 || c.Ports[0].HostPort != 50000:
		t.Errorf("ports %+v, want host port 50000", c.Ports)
	case pod.Spec.Volumes[0].HostPath.Path != daemon.Dir || !c.VolumeMounts[0].ReadOnly:
		t.Errorf("configuration volume %+v mounted %+v, want %s read-only", pod.Spec.Volumes[0], c.VolumeMounts[0], daemon.Dir)
	}

	if err := d.Stop(ctx, daemon.Daemon); err != nil {
		t.Fatal(err)
	}
	if _, err := client.CoreV1().Pods("tessera-system").Get(ctx, daemon.Pod, metav1.GetOptions{}); err == nil {
		t.Error("the daemon's pod is still there after Stop")
	}
	if _, err := os.Stat(daemon.Dir); !os.IsNotExist(err) {
		t.Errorf("the daemon's directory is still there after Stop: %v", err)
	}
	if err := d.Stop(ctx, daemon.Daemon); err != nil {
		t.Errorf("a second Stop: %v", err)
	}
}

func TestACrashingDaemonFailsStartWithItsLastWords(t *testing.T) {
	client := newClient()
	kubelet(client, func(p *corev1.Pod) {
		p.Status.Phase = corev1.PodRunning
		p.Status.ContainerStatuses = []corev1.ContainerStatus{{
			Name:                 "imex-daemon",
			State:                corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "CrashLoopBackOff", Message: "back-off 10s restarting failed container"}},
			LastTerminationState: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 1, Message: "nvidia-imex: BIND_INTERFACE_IP 10.0.0.2 is not an address of this machine"}},
		}}
	})
	d := daemons(client, t.TempDir())
	d.ReadyTimeout = 300 * time.Millisecond
	err := d.Start(context.Background(), gang(d, trays...))
	for _, want := range []string{"claim ml/train-domain", "not ready", "CrashLoopBackOff", "BIND_INTERFACE_IP 10.0.0.2 is not an address"} {
		if !strings.Contains(errString(err), want) {
			t.Errorf("Start of a crashing daemon: %v; want it to say %q", err, want)
		}
	}
}

func TestADaemonOfAnEarlierPlacementIsReplaced(t *testing.T) {
	ctx := context.Background()
	client := newClient()
	creations := kubelet(client, ready)
	d := daemons(client, t.TempDir())
	if err := d.Start(ctx, gang(d, gangv1.Node{Name: "tray-2", Address: "10.0.0.2"}, gangv1.Node{Name: "tray-3", Address: "10.0.0.3"})); err != nil {
		t.Fatal(err)
	}
	if err := d.Start(ctx, gang(d, trays...)); err != nil {
		t.Fatal(err)
	}
	pod, err := client.CoreV1().Pods("tessera-system").Get(ctx, "tessera-imex-uid-1-tray-2", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := pod.Annotations[imex.AnnotationNodes]; got != "10.0.0.1,10.0.0.2" || *creations != 2 {
		t.Errorf("daemon pod for nodes %q after %d creations; want the new placement's 10.0.0.1,10.0.0.2 in a second pod", got, *creations)
	}
	// The same placement again (the kubelet's retry) keeps the pod.
	if err := d.Start(ctx, gang(d, trays...)); err != nil || *creations != 2 {
		t.Errorf("a retried Start: %v, %d creations; want the pod kept", err, *creations)
	}
}

func TestBadGangNodesAreRefusedNamingTheFix(t *testing.T) {
	d := daemons(newClient(), t.TempDir())
	for name, tc := range map[string]struct {
		nodes []gangv1.Node
		want  string
	}{
		"none":              {nil, "annotation gang.tessera.dev/nodes is missing"},
		"not this node":     {[]gangv1.Node{{Name: "tray-1", Address: "10.0.0.1"}}, "this node (tray-2) is not among the gang's nodes"},
		"a node without IP": {[]gangv1.Node{{Name: "tray-1"}, {Name: "tray-2", Address: "10.0.0.2"}}, "node tray-1 has no usable address"},
		"a shared address":  {[]gangv1.Node{{Name: "tray-1", Address: "10.0.0.2"}, {Name: "tray-2", Address: "10.0.0.2"}}, "appears twice"},
	} {
		_, _, err := d.Config(gang(d, tc.nodes...))
		if !strings.Contains(errString(err), tc.want) {
			t.Errorf("%s: %v; want it to say %q", name, err, tc.want)
		}
	}
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// Every node of a gang runs a daemon for the same claim, in the same
// namespace: each must be a pod of its own, not the first node's found by
// the others.
func TestEachNodeRunsItsOwnDaemonForTheGangsClaim(t *testing.T) {
	ctx := context.Background()
	client := newClient()
	creations := kubelet(client, ready)
	dir := t.TempDir()
	one, two := daemons(client, filepath.Join(dir, "tray-1")), daemons(client, filepath.Join(dir, "tray-2"))
	one.NodeName = "tray-1"
	if err := one.Start(ctx, gang(one, trays...)); err != nil {
		t.Fatal(err)
	}
	if err := two.Start(ctx, gang(two, trays...)); err != nil {
		t.Fatal(err)
	}
	pods, err := client.CoreV1().Pods("tessera-system").List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var nodes []string
	for _, p := range pods.Items {
		nodes = append(nodes, p.Spec.NodeName)
	}
	if *creations != 2 || strings.Join(nodes, ",") != "tray-1,tray-2" {
		t.Errorf("%d creations, daemon pods on %v; want one pod on each tray", *creations, nodes)
	}
	long := daemons(client, dir)
	long.NodeName = strings.Repeat("n", 250)
	if name := long.Locate("0f1e2d3c-0000-4000-9000-000000000001").Pod; len(name) > 253 {
		t.Errorf("pod name of %d characters for a long node name, want at most 253", len(name))
	}
}

// A daemon the kubelet refused or evicted (the pod Failed) is replaced by
// the kubelet's retry of the prepare, not waited on forever.
func TestAnEndedDaemonIsReplaced(t *testing.T) {
	ctx := context.Background()
	client := newClient()
	failed := true
	creations := kubelet(client, func(p *corev1.Pod) {
		if failed {
			p.Status.Phase = corev1.PodFailed
			p.Status.Reason = "OutOfhostPort"
			failed = false
			return
		}
		ready(p)
	})
	d := daemons(client, t.TempDir())
	d.ReadyTimeout = 300 * time.Millisecond
	err := d.Start(ctx, gang(d, trays...))
	if !strings.Contains(errString(err), "ended (Failed): OutOfhostPort") {
		t.Fatalf("Start whose pod the kubelet refused: %v, want the reason", err)
	}
	if err := d.Start(ctx, gang(d, trays...)); err != nil || *creations != 2 {
		t.Errorf("the retry: %v after %d creations; want a new pod, ready", err, *creations)
	}
}

// The address the claim gives this node must be one of the Node's own:
// whoever edits the annotation cannot make the daemon bind elsewhere.
func TestTheDaemonBindsOnlyTheNodesOwnAddress(t *testing.T) {
	client := newClient()
	kubelet(client, ready)
	d := daemons(client, t.TempDir())
	err := d.Start(context.Background(), gang(d, gangv1.Node{Name: "tray-1", Address: "10.0.0.1"}, gangv1.Node{Name: "tray-2", Address: "127.0.0.1"}))
	if !strings.Contains(errString(err), "the address 127.0.0.1, which is not one of its InternalIPs [10.0.0.2]") {
		t.Errorf("Start with another address for this node: %v", err)
	}
}

// A daemon located by an empty claim UID (a pod without its label) names
// the directory of every claim's: Stop refuses to remove it.
func TestStopNeverRemovesEveryClaimsDirectory(t *testing.T) {
	dir := t.TempDir()
	d := daemons(newClient(), dir)
	keep := filepath.Join(dir, "uid-1", imex.ConfigFile)
	if err := os.MkdirAll(filepath.Dir(keep), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keep, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := d.Stop(context.Background(), d.Locate("")); err == nil {
		t.Error("Stop of a daemon of no claim succeeded")
	}
	if _, err := os.Stat(keep); err != nil {
		t.Errorf("another claim's configuration is gone: %v", err)
	}
}

// TestWithoutAnImageNoDaemonStarts: a plugin without --imex-image creates
// no daemon pod (its Stop is Host.Stop, as with an image).
func TestWithoutAnImageNoDaemonStarts(t *testing.T) {
	client := newClient()
	d := daemons(client, t.TempDir())
	d.Image = ""
	if err := d.Start(context.Background(), gang(d, trays...)); err == nil || !strings.Contains(err.Error(), "--imex-image") {
		t.Errorf("start without an image: %v, want a refusal naming --imex-image", err)
	}
	if pods, err := client.CoreV1().Pods("tessera-system").List(context.Background(), metav1.ListOptions{}); err != nil || len(pods.Items) != 0 {
		t.Errorf("pods after the refused start: %v %v, want none", pods, err)
	}
}
