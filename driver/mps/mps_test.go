package mps_test

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/tessera-dev/tessera/driver/daemonpod"
	"github.com/tessera-dev/tessera/driver/mps"
	"github.com/tessera-dev/tessera/driver/prepare"
)

// runPods plays the kubelet: every daemon pod created gets a running
// container.
func runPods(ctx context.Context, t *testing.T, client *fake.Clientset, ns string) {
	go func() {
		for ctx.Err() == nil {
			pods, _ := client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
			for _, p := range pods.Items {
				if len(p.Status.ContainerStatuses) == 0 {
					p.Status.Phase = corev1.PodRunning
					p.Status.ContainerStatuses = []corev1.ContainerStatus{{Name: "mps-control-daemon", State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}}}
					_, _ = client.CoreV1().Pods(ns).UpdateStatus(ctx, &p, metav1.UpdateOptions{})
				}
			}
			time.Sleep(20 * time.Millisecond)
		}
	}()
}

func TestDaemonRunsAsAPodOnItsNodeAndIsStopped(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	client := fake.NewClientset()
	runPods(ctx, t, client, "tessera-system")
	d := &mps.Daemons{Host: daemonpod.Host{Client: client, Namespace: "tessera-system", NodeName: "node-a", Image: "registry.example/tessera:v1", Dir: t.TempDir(), DriverRoot: "/run/nvidia/driver"}}
	loc := d.Locate("uid-1")
	daemon := prepare.MPSDaemon{MPSDaemon: loc, ClaimUID: "uid-1", ClaimNamespace: "ml", ClaimName: "infer", Devices: []string{"GPU-a", "GPU-b"}, Env: []string{"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25"}}
	edits, err := d.Start(ctx, daemon)
	if err != nil {
		t.Fatal(err)
	}
	pod, err := client.CoreV1().Pods("tessera-system").Get(ctx, loc.Pod, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if pod.Spec.NodeName != "node-a" || pod.Labels[mps.LabelClaimUID] != "uid-1" || pod.Spec.RestartPolicy != corev1.RestartPolicyAlways {
		t.Errorf("pod placement/labels/restart: node %q labels %v restart %s", pod.Spec.NodeName, pod.Labels, pod.Spec.RestartPolicy)
	}
	c := pod.Spec.Containers[0]
	if c.Command[0] != "/driver-root/usr/bin/nvidia-cuda-mps-control" || c.Command[1] != "-f" {
		t.Errorf("daemon command %v", c.Command)
	}
	env := map[string]string{}
	for _, e := range c.Env {
		env[e.Name] = e.Value
	}
	if env["CUDA_VISIBLE_DEVICES"] != "GPU-a,GPU-b" || env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] != "25" || env["CUDA_MPS_PIPE_DIRECTORY"] != mps.PipeDir {
		t.Errorf("daemon env %v", env)
	}
	for _, sub := range []string{"pipe", "log", "shm"} {
		if _, err := os.Stat(filepath.Join(loc.Dir, sub)); err != nil {
			t.Errorf("daemon directory %s: %v", sub, err)
		}
	}
	if !slices.Contains(edits.Env, "CUDA_MPS_PIPE_DIRECTORY="+mps.PipeDir) || !slices.Contains(edits.Env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25") || len(edits.Mounts) != 3 {
		t.Errorf("client edits %+v", edits)
	}
	// Idempotent: a retried prepare finds the daemon running.
	if _, err := d.Start(ctx, daemon); err != nil {
		t.Fatalf("second start: %v", err)
	}
	if err := d.Stop(ctx, loc); err != nil {
		t.Fatal(err)
	}
	if err := d.Stop(ctx, loc); err != nil {
		t.Fatalf("second stop: %v", err)
	}
	if _, err := client.CoreV1().Pods("tessera-system").Get(ctx, loc.Pod, metav1.GetOptions{}); err == nil {
		t.Error("daemon pod still exists after stop")
	}
	if _, err := os.Stat(loc.Dir); !os.IsNotExist(err) {
		t.Errorf("daemon directory still exists after stop: %v", err)
	}
}

func TestStartFailsWithTheReasonWhenTheDaemonDoesNotRun(t *testing.T) {
	client := fake.NewClientset()
	d := &mps.Daemons{Host: daemonpod.Host{Client: client, Namespace: "tessera-system", NodeName: "node-a", Image: "missing:latest", Dir: t.TempDir(), ReadyTimeout: 300 * time.Millisecond}}
	go func() {
		time.Sleep(50 * time.Millisecond)
		p, err := client.CoreV1().Pods("tessera-system").Get(context.Background(), "tessera-mps-uid-2", metav1.GetOptions{})
		if err != nil {
			return
		}
		p.Status.ContainerStatuses = []corev1.ContainerStatus{{State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "ImagePullBackOff", Message: "missing:latest not found"}}}}
		_, _ = client.CoreV1().Pods("tessera-system").UpdateStatus(context.Background(), p, metav1.UpdateOptions{})
	}()
	_, err := d.Start(context.Background(), prepare.MPSDaemon{MPSDaemon: d.Locate("uid-2"), ClaimUID: "uid-2"})
	if err == nil || !containsAll(err.Error(), "ImagePullBackOff", "--mps-image") {
		t.Errorf("start of a daemon that cannot run: %v", err)
	}
}

// TestClaimsListsThisNodesDaemons: the daemon sweep looks at this node's
// daemons, never another node's.
func TestClaimsListsThisNodesDaemons(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	client := fake.NewClientset()
	runPods(ctx, t, client, "tessera-system")
	d := &mps.Daemons{Host: daemonpod.Host{Client: client, Namespace: "tessera-system", NodeName: "node-a", Image: "img", Dir: t.TempDir()}}
	other := &mps.Daemons{Host: daemonpod.Host{Client: client, Namespace: "tessera-system", NodeName: "node-b", Image: "img", Dir: t.TempDir()}}
	for _, s := range []struct {
		d   *mps.Daemons
		uid string
	}{{d, "keep"}, {d, "gone"}, {other, "elsewhere"}} {
		if _, err := s.d.Start(ctx, prepare.MPSDaemon{MPSDaemon: s.d.Locate(s.uid), ClaimUID: s.uid}); err != nil {
			t.Fatal(err)
		}
	}
	uids, err := d.Claims(ctx)
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(uids)
	if want := []string{"gone", "keep"}; !slices.Equal(uids, want) {
		t.Errorf("daemons of node-a's claims %v, want %v (another node's daemon is not ours)", uids, want)
	}
}

func containsAll(s string, subs ...string) bool {
	for _, sub := range subs {
		if !strings.Contains(s, sub) {
			return false
		}
	}
	return true
}

// TestDaemonFindsTheDriverWhereverTheDistributionInstalledIt: the daemon
// loads libcuda and libnvidia-ml from the driver root, so its loader path
// covers every directory a distribution installs the driver's libraries in
// (the containers' CDI specs find them in each): Debian and Ubuntu
// multiarch with and without the merged /usr, Red Hat and SUSE lib64 with
// and without it, Grace's aarch64 multiarch, and plain /usr/lib.
func TestDaemonFindsTheDriverWhereverTheDistributionInstalledIt(t *testing.T) {
	d := &mps.Daemons{Host: daemonpod.Host{Namespace: "tessera-system", NodeName: "node-a", Image: "registry.example/tessera:v1", Dir: t.TempDir(), DriverRoot: "/"}}
	pod := d.Pod(prepare.MPSDaemon{MPSDaemon: d.Locate("uid-1"), ClaimUID: "uid-1", ClaimNamespace: "ml", ClaimName: "infer", Devices: []string{"GPU-a"}})
	var path []string
	for _, e := range pod.Spec.Containers[0].Env {
		if e.Name == "LD_LIBRARY_PATH" {
			path = strings.Split(e.Value, ":")
		}
	}
	for _, dir := range []string{
		"usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu",
		"usr/lib64", "lib64",
		"usr/lib/aarch64-linux-gnu", "lib/aarch64-linux-gnu",
		"usr/lib",
	} {
		if !slices.Contains(path, "/driver-root/"+dir) {
			t.Errorf("the daemon's LD_LIBRARY_PATH %v lacks /driver-root/%s: a driver installed there is not found", path, dir)
		}
	}
}

// TestWithoutAnImageNoDaemonStartsButOneStops: a plugin without
// --mps-image creates no daemon pod, and still stops one that ran.
func TestWithoutAnImageNoDaemonStartsButOneStops(t *testing.T) {
	ctx := context.Background()
	client := fake.NewClientset()
	d := &mps.Daemons{Host: daemonpod.Host{Client: client, Namespace: "tessera-system", NodeName: "node-a", Dir: t.TempDir()}}
	if _, err := d.Start(ctx, prepare.MPSDaemon{MPSDaemon: d.Locate("uid-1"), ClaimUID: "uid-1"}); err == nil || !strings.Contains(err.Error(), "--mps-image") {
		t.Errorf("start without an image: %v, want a refusal naming --mps-image", err)
	}
	ran := d.Locate("uid-2")
	if _, err := client.CoreV1().Pods("tessera-system").Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: ran.Pod, Namespace: "tessera-system"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(ran.Dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := d.Stop(ctx, ran); err != nil {
		t.Fatalf("stop without an image: %v", err)
	}
	pods, err := client.CoreV1().Pods("tessera-system").List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(ran.Dir); len(pods.Items) != 0 || !os.IsNotExist(err) {
		t.Errorf("after the stop: pods %d, directory %v; want neither", len(pods.Items), err)
	}
}

// TestAClaimsDaemonIsNeverAPodOnItsWayOutOrOnAnotherNode: the one rule every
// daemon kind shares (daemonpod.Host.Ensure). A pod of the claim's daemon
// name on another node (the claim was prepared there before its node died)
// fails the start naming that node, and stays; one being deleted (a claim
// prepared again within the termination grace) is waited for and replaced,
// never taken for the running daemon; and a stop returns only once the pod
// is gone.
func TestAClaimsDaemonIsNeverAPodOnItsWayOutOrOnAnotherNode(t *testing.T) {
	const ns = "tessera-system"
	newDaemons := func(client *fake.Clientset) *mps.Daemons {
		return &mps.Daemons{Host: daemonpod.Host{Client: client, Namespace: ns, NodeName: "node-a", Image: "registry.example/tessera:v1", Dir: t.TempDir(), DriverRoot: "/run/nvidia/driver"}}
	}
	running := corev1.PodStatus{Phase: corev1.PodRunning, ContainerStatuses: []corev1.ContainerStatus{{Name: "mps-control-daemon", State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}}}}

	t.Run("on another node", func(t *testing.T) {
		client := fake.NewClientset()
		d := newDaemons(client)
		loc := d.Locate("uid-1")
		other := d.Pod(prepare.MPSDaemon{MPSDaemon: loc, ClaimUID: "uid-1"})
		other.Spec.NodeName, other.Status = "node-b", running
		if _, err := client.CoreV1().Pods(ns).Create(context.Background(), other, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		_, err := d.Start(context.Background(), prepare.MPSDaemon{MPSDaemon: loc, ClaimUID: "uid-1"})
		if err == nil || !containsAll(err.Error(), "node-b", loc.Pod) {
			t.Fatalf("start beside the claim's daemon pod on node-b: %v, want an error naming it", err)
		}
		if p, err := client.CoreV1().Pods(ns).Get(context.Background(), loc.Pod, metav1.GetOptions{}); err != nil || p.Spec.NodeName != "node-b" {
			t.Errorf("the other node's pod: %v %v", p, err)
		}
	})

	t.Run("being deleted", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		client := fake.NewClientset()
		d := newDaemons(client)
		loc := d.Locate("uid-1")
		old := d.Pod(prepare.MPSDaemon{MPSDaemon: loc, ClaimUID: "uid-1"})
		old.Status, old.DeletionTimestamp, old.Annotations["test/generation"] = running, &metav1.Time{Time: time.Now()}, "old"
		if _, err := client.CoreV1().Pods(ns).Create(ctx, old, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		runPods(ctx, t, client, ns)
		if _, err := d.Start(ctx, prepare.MPSDaemon{MPSDaemon: loc, ClaimUID: "uid-1"}); err != nil {
			t.Fatal(err)
		}
		p, err := client.CoreV1().Pods(ns).Get(ctx, loc.Pod, metav1.GetOptions{})
		if err != nil || p.DeletionTimestamp != nil || p.Annotations["test/generation"] == "old" {
			t.Errorf("after the start the claim's daemon pod (%v) is deleted since %v, generation %q: want a new pod, not the one being deleted", err, p.GetDeletionTimestamp(), p.GetAnnotations()["test/generation"])
		}
	})

	t.Run("stop waits until gone", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		client := fake.NewClientset()
		d := newDaemons(client)
		loc := d.Locate("uid-1")
		runPods(ctx, t, client, ns)
		if _, err := d.Start(ctx, prepare.MPSDaemon{MPSDaemon: loc, ClaimUID: "uid-1"}); err != nil {
			t.Fatal(err)
		}
		// The API server keeps a deleted pod, terminating, until its
		// kubelet has stopped it: here, until the stop has looked twice.
		var deleted, looked atomic.Int32
		client.PrependReactor("delete", "pods", func(k8stesting.Action) (bool, runtime.Object, error) {
			deleted.Add(1)
			return true, nil, nil
		})
		client.PrependReactor("get", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
			if deleted.Load() > 0 && looked.Add(1) == 2 {
				_ = client.Tracker().Delete(corev1.SchemeGroupVersion.WithResource("pods"), ns, loc.Pod)
			}
			return false, nil, nil
		})
		if err := d.Stop(ctx, loc); err != nil {
			t.Fatal(err)
		}
		if _, err := client.CoreV1().Pods(ns).Get(ctx, loc.Pod, metav1.GetOptions{}); err == nil {
			t.Errorf("stop returned while the daemon pod was still there (looked %d times after deleting)", looked.Load())
		}
	})
}
