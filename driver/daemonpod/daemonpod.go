// Package daemonpod holds what the kubelet plugin's daemon pods (MPS control
// daemons, IMEX daemons) share: the one rule for when an existing pod is a
// claim's daemon (Ensure), waiting for a pod to serve, deleting it and
// waiting for it to be gone, listing a node's daemons, and where the
// driver's libraries are inside a daemon container.
package daemonpod

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/driverfiles"
)

// Labels on every daemon pod: which daemon, on which node, for which claim.
const (
	LabelApp      = "app.kubernetes.io/name"
	LabelNode     = "gpu.tessera.dev/node"
	LabelClaimUID = "gpu.tessera.dev/claim-uid"
	// AnnotationClaim is "<namespace>/<name>" of the claim a daemon serves.
	AnnotationClaim = "gpu.tessera.dev/claim"
)

// Host is where a node's daemon pods run and what they run: the same for
// every kind of daemon.
type Host struct {
	Client    kubernetes.Interface
	Namespace string
	NodeName  string
	// Image runs the daemons; only its filesystem is used (a shell-less
	// distroless image is fine).
	Image string
	// Dir on the host holds the daemons' files, one subdirectory per
	// claim.
	Dir string
	// DriverRoot is the host's driver root, where the daemons' binaries
	// are.
	DriverRoot string
	// ReadyTimeout bounds how long a start waits for a daemon to serve
	// (30 s when zero); the kubelet gives a prepare 45 s.
	ReadyTimeout time.Duration
}

// Runs says whether daemons start here: Image is set. Without it, Stop and
// Claims still clean up the daemons an earlier configuration started, so
// that turning a kind of daemon off never leaves a claim that cannot be
// unprepared.
func (h *Host) Runs() bool { return h.Image != "" }

// Labels are a daemon pod's labels: its app, this node and its claim.
func (h *Host) Labels(app, claimUID string) map[string]string {
	return map[string]string{LabelApp: app, LabelNode: h.NodeName, LabelClaimUID: claimUID}
}

// Pod is what every daemon pod is: name in Namespace, labelled for app,
// this node and its claim (claimRef "<namespace>/<name>", claimUID), pinned
// to this node, restarted when it exits, tolerating every taint (it serves
// pods already admitted here), the default service account without a token
// (a daemon calls no API), and one privileged container (it opens the GPUs'
// device nodes) running Image. The caller adds the rest (host network,
// annotations); the chart's lock policies pin all of it (mps-lock.yaml,
// imex-lock.yaml).
func (h *Host) Pod(name, app, claimUID, claimRef string, c corev1.Container, volumes ...corev1.Volume) *corev1.Pod {
	c.Image = h.Image
	c.SecurityContext = &corev1.SecurityContext{Privileged: ptr.To(true)}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name:        name,
			Namespace:   h.Namespace,
			Labels:      h.Labels(app, claimUID),
			Annotations: map[string]string{AnnotationClaim: claimRef},
		},
		Spec: corev1.PodSpec{
			NodeName:                      h.NodeName,
			RestartPolicy:                 corev1.RestartPolicyAlways,
			Tolerations:                   []corev1.Toleration{{Operator: corev1.TolerationOpExists}},
			TerminationGracePeriodSeconds: ptr.To[int64](5),
			ServiceAccountName:            "default",
			AutomountServiceAccountToken:  ptr.To(false),
			Containers:                    []corev1.Container{c},
			Volumes:                       volumes,
		},
	}
}

// Ensure makes pod, a claim's daemon named by the claim, exist on this
// node, one rule for every kind of daemon: absent, it is created; a pod of
// that name on another node is an error naming it (the claim moved, its old
// node died: this node's token may not delete it, and pod GC does once that
// node is gone, after which a retry starts the daemon here); one being
// deleted, one that ended (the kubelet refused or evicted it), or one that
// current says is not the daemon wanted (nil: any is) is deleted and waited
// for until it is gone, then created afresh; else it is kept. A daemon is
// never taken for running while its pod is on its way out. what names the
// daemon in messages ("MPS daemon").
func (h *Host) Ensure(ctx context.Context, pod *corev1.Pod, current func(existing *corev1.Pod) bool, what string) error {
	pods := h.Client.CoreV1().Pods(h.Namespace)
	existing, err := pods.Get(ctx, pod.Name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
	case err != nil:
		return fmt.Errorf("read %s pod %s/%s: %w", what, h.Namespace, pod.Name, err)
	case existing.Spec.NodeName != h.NodeName:
		return fmt.Errorf("%s pod %s/%s is on node %s, not on this node %s (its claim was prepared there before); it is deleted with that node's pods, or delete it yourself", what, h.Namespace, pod.Name, existing.Spec.NodeName, h.NodeName)
	case existing.DeletionTimestamp == nil && existing.Status.Phase != corev1.PodFailed && existing.Status.Phase != corev1.PodSucceeded &&
		(current == nil || current(existing)):
		return nil
	default:
		klog.FromContext(ctx).Info("Replacing a daemon pod being deleted, ended or of an earlier configuration", "daemon", what, "pod", klog.KObj(existing), "phase", existing.Status.Phase, "deleting", existing.DeletionTimestamp != nil)
		if err := Delete(ctx, h.Client, h.Namespace, pod.Name, true, h.ReadyTimeout, what); err != nil {
			return err
		}
	}
	if _, err := pods.Create(ctx, pod, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create %s pod %s/%s: %w", what, h.Namespace, pod.Name, err)
	}
	return nil
}

// Stop deletes a daemon's pod (with gone, waits until it is gone) and
// removes its directory, which must lie inside Dir: a daemon located by an
// empty claim UID would name Dir itself, every claim's. what names the
// daemon in errors ("MPS daemon").
func (h *Host) Stop(ctx context.Context, daemon checkpoint.Daemon, gone bool, what string) error {
	if rel, err := filepath.Rel(h.Dir, daemon.Dir); err != nil || rel == "." || strings.HasPrefix(rel, "..") {
		return fmt.Errorf("%s %s: directory %s is not a claim's directory inside %s; refusing to remove it", what, daemon.Pod, daemon.Dir, h.Dir)
	}
	if err := Delete(ctx, h.Client, h.Namespace, daemon.Pod, gone, h.ReadyTimeout, what); err != nil {
		return err
	}
	if err := os.RemoveAll(daemon.Dir); err != nil {
		return fmt.Errorf("remove the %s's directory: %w", what, err)
	}
	return nil
}

// Claims lists the claim UIDs of this node's daemons of one app, for the
// daemon sweep to stop those of claims the node does not hold.
func (h *Host) Claims(ctx context.Context, app string) ([]string, error) {
	return Claims(ctx, h.Client, h.Namespace, app, h.NodeName)
}

// HostDirectory is a volume of a host directory that must exist.
func HostDirectory(name, path string) corev1.Volume {
	t := corev1.HostPathDirectory
	return corev1.Volume{Name: name, VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: path, Type: &t}}}
}

// DriverRootMount is where a daemon container sees the host's driver root
// (mounted read-only).
const DriverRootMount = "/driver-root"

// LibraryPath is LD_LIBRARY_PATH for a daemon run from the mounted driver
// root: every directory the containers' driver files are looked for in
// (driverfiles.LibDirs), in the same order. The daemons' admission policies
// pin this value: change them together.
func LibraryPath() string {
	out := ""
	for i, dir := range driverfiles.LibDirs {
		if i > 0 {
			out += ":"
		}
		out += DriverRootMount + "/" + dir
	}
	return out
}

// Until says whether a daemon pod serves: Running (its container runs) or
// Ready (its readiness probe passes).
type Until int

const (
	Running Until = iota
	Ready
)

// Wait polls the pod until it serves, it ends, or timeout passes (30 s when
// zero). what names the daemon in errors ("MPS daemon"), fix says what to
// check when it does not come up.
func Wait(ctx context.Context, client kubernetes.Interface, ns, name string, until Until, timeout time.Duration, what, fix string) error {
	if timeout == 0 {
		timeout = 30 * time.Second
	}
	var last string
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		pod, err := client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			last = err.Error()
			return false, nil
		}
		if pod.Status.Phase == corev1.PodFailed || pod.Status.Phase == corev1.PodSucceeded {
			msg := pod.Status.Message
			if msg == "" {
				msg = pod.Status.Reason
			}
			return false, fmt.Errorf("%s pod %s/%s ended (%s): %s", what, ns, name, pod.Status.Phase, msg)
		}
		last = ""
		for _, cs := range pod.Status.ContainerStatuses {
			switch {
			case cs.State.Running != nil && (until == Running || cs.Ready):
				return true, nil
			case cs.State.Running != nil:
				last = "running, not ready (its readiness probe fails)"
			case cs.State.Waiting != nil:
				last = cs.State.Waiting.Reason + ": " + cs.State.Waiting.Message
			}
			if t := cs.LastTerminationState.Terminated; t != nil {
				last += fmt.Sprintf("; last exit %d: %s", t.ExitCode, t.Message)
			}
		}
		if last == "" {
			last = "phase " + string(pod.Status.Phase)
		}
		return false, nil
	})
	if err != nil {
		return fmt.Errorf("%s pod %s/%s not %s after %v (last seen: %s); %s: %w", what, ns, name, map[Until]string{Running: "running", Ready: "ready"}[until], timeout, last, fix, err)
	}
	return nil
}

// Delete deletes a daemon pod; a pod already gone succeeds. With wait set
// it returns only once the pod is gone (its container stopped), within
// timeout (30 s when zero).
func Delete(ctx context.Context, client kubernetes.Interface, ns, name string, gone bool, timeout time.Duration, what string) error {
	err := client.CoreV1().Pods(ns).Delete(ctx, name, metav1.DeleteOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("delete %s pod %s/%s: %w", what, ns, name, err)
	}
	if !gone {
		return nil
	}
	if timeout == 0 {
		timeout = 30 * time.Second
	}
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		_, err := client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	})
	if err != nil {
		return fmt.Errorf("%s pod %s/%s still there %v after its deletion; check the node's kubelet: %w", what, ns, name, timeout, err)
	}
	return nil
}

// Claims lists the claim UIDs of a node's daemons of one app.
func Claims(ctx context.Context, client kubernetes.Interface, ns, app, node string) ([]string, error) {
	pods, err := client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: LabelApp + "=" + app + "," + LabelNode + "=" + node})
	if err != nil {
		return nil, fmt.Errorf("list %s pods: %w", app, err)
	}
	out := make([]string, 0, len(pods.Items))
	for _, pod := range pods.Items {
		// A pod without a claim UID names no daemon directory: stopping
		// it by an empty UID would remove every claim's.
		if uid := pod.Labels[LabelClaimUID]; uid != "" && !strings.ContainsAny(uid, "/.") {
			out = append(out, uid)
		}
	}
	return out, nil
}
