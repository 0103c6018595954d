package e2e

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"
	appsv1 "k8s.io/api/apps/v1"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"

	"github.com/tessera-dev/tessera/deployments/helm"
	"github.com/tessera-dev/tessera/deployments/rbac"
	"github.com/tessera-dev/tessera/driver/mps"
	"github.com/tessera-dev/tessera/driver/plugin"
	"github.com/tessera-dev/tessera/driver/prepare"
	"github.com/tessera-dev/tessera/test/cluster"
)

// This file holds the checks TestHelmChartAppliesOnTheAPIServer runs after
// installing each values combination: what a node's token may write, with
// the chart's admission policies loaded on the real API server.

// tokenClient is an API client with a token of service account
// namespace/account, bound to node boundTo (none when empty), as the
// kubelet's projected token of a pod on that node is.
func tokenClient(ctx context.Context, t *testing.T, c *cluster.Cluster, namespace, account, boundTo string) kubernetes.Interface {
	t.Helper()
	admin := c.Client()
	spec := authenticationv1.TokenRequestSpec{ExpirationSeconds: ptr.To(int64(3600))}
	if boundTo != "" {
		node, err := admin.CoreV1().Nodes().Get(ctx, boundTo, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		spec.BoundObjectRef = &authenticationv1.BoundObjectReference{Kind: "Node", APIVersion: "v1", Name: node.Name, UID: node.UID}
	}
	tr, err := admin.CoreV1().ServiceAccounts(namespace).CreateToken(ctx, account, &authenticationv1.TokenRequest{Spec: spec}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("token of %s/%s bound to %q: %v", namespace, account, boundTo, err)
	}
	cfg := rest.AnonymousClientConfig(c.RESTConfig())
	cfg.BearerToken = tr.Status.Token
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return client
}

// refusedOnceLoaded calls write until it is refused, undoing with undo each
// write the API server accepted because it had not loaded the policy yet,
// and returns the refusal. Policies load asynchronously after their
// creation: waiting for the refusal itself races nothing.
func refusedOnceLoaded(ctx context.Context, write func(attempt int) error, undo func(attempt int)) error {
	var refusal error
	attempt := 0
	err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		attempt++
		if refusal = write(attempt); refusal == nil {
			undo(attempt)
			return false, nil
		}
		return true, nil
	})
	if err != nil {
		return fmt.Errorf("still accepted after 60 s: %w", err)
	}
	return refusal
}

// expectRefusal reports a write that was accepted, or refused for another
// reason than want, and returns whether it was refused as wanted.
func expectRefusal(t *testing.T, what string, err error, want string) bool {
	t.Helper()
	if err == nil {
		t.Errorf("%s: accepted, want refused (%q)", what, want)
		return false
	}
	if !apierrors.IsForbidden(err) && !apierrors.IsInvalid(err) || !strings.Contains(err.Error(), want) {
		t.Errorf("%s: refused for another reason: %v; want %q", what, err, want)
		return false
	}
	return true
}

// pluginOptions parses the rendered DaemonSet's plugin flags as the plugin
// does.
func pluginOptions(t *testing.T, combo string, manifests []helm.Manifest) plugin.Options {
	t.Helper()
	for _, m := range manifests {
		if m.Kind != "DaemonSet" {
			continue
		}
		var ds appsv1.DaemonSet
		if err := yaml.Unmarshal([]byte(m.YAML), &ds); err != nil {
			t.Fatalf("%s: %s: %v", combo, m.Source, err)
		}
		ctr := ds.Spec.Template.Spec.Containers[0]
		var o plugin.Options
		fs := pflag.NewFlagSet(ctr.Command[0], pflag.ContinueOnError)
		fs.ParseErrorsAllowlist.UnknownFlags = true // klog's, added by component.Run
		o.AddFlags(fs)
		if err := fs.Parse(ctr.Args); err != nil {
			t.Fatalf("%s: plugin arguments %q: %v", combo, ctr.Args, err)
		}
		return o
	}
	t.Fatalf("%s: no DaemonSet rendered", combo)
	return plugin.Options{}
}

// checkMPSLock creates pods as the chart's kubelet-plugin service account
// in namespace, with a token bound to node-a, as the plugin does for MPS
// daemons. The daemon pod driver/mps builds from the DaemonSet's own flags
// (image, data directory, driver root) is accepted and can be deleted; the
// same pod on node-b, with another service account or a token, another image
// or command, a further host path, a writable driver root, host namespaces,
// an added capability or a second container is refused by the chart's
// MPS-lock policy (once the API server has loaded it), and so is deleting
// node-b's daemon.
func checkMPSLock(ctx context.Context, t *testing.T, c *cluster.Cluster, combo, namespace string, manifests []helm.Manifest) {
	t.Helper()
	admin := c.Client()
	o := pluginOptions(t, combo, manifests)
	root := o.Node.DriverRoot
	if o.Node.FakeNode != "" {
		root = o.Node.FakeRoot // a fake node's driver lives there
	}
	daemonPod := func(node string, n int) *corev1.Pod {
		d := &mps.Daemons{Namespace: namespace, NodeName: node, Image: o.MPSImage, Dir: filepath.Join(o.PluginDataDir, "mps"), DriverRoot: root}
		uid := fmt.Sprintf("0f1e2d3c-0000-4000-8000-%012d", n)
		return d.Pod(prepare.MPSDaemon{
			MPSDaemon: d.Locate(uid), ClaimUID: uid, ClaimNamespace: "default", ClaimName: "mps",
			Devices: []string{"GPU-0"}, Env: []string{"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1024M"},
		})
	}
	// Daemon pods run as the namespace's default service account, which
	// must exist before a pod can name it.
	if err := c.CreateNamespace(ctx, namespace); err != nil {
		t.Fatal(err)
	}
	pods := tokenClient(ctx, t, c, namespace, rbac.KubeletPluginAccount, "node-a").CoreV1().Pods(namespace)
	// No kubelet finishes the deletion of a pod bound to a node here: force
	// it, so that the namespace can go.
	defer forceDeletePods(ctx, t, admin, namespace, mps.LabelApp+"="+mps.AppName)
	create := func(p *corev1.Pod) error {
		_, err := pods.Create(ctx, p, metav1.CreateOptions{})
		if err == nil {
			_ = admin.CoreV1().Pods(namespace).Delete(ctx, p.Name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)})
		}
		return err
	}

	start := time.Now()
	err := refusedOnceLoaded(ctx, func(int) error {
		_, err := pods.Create(ctx, daemonPod("node-b", 1), metav1.CreateOptions{})
		return err
	}, func(int) {
		_ = admin.CoreV1().Pods(namespace).Delete(ctx, daemonPod("node-b", 1).Name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)})
	})
	if !strings.Contains(fmt.Sprint(err), "may only run and delete MPS daemon pods on its own node") {
		t.Errorf("%s: the plugin's account in %s, bound to node-a, ran a daemon pod on node-b or was refused for another reason: %v", combo, namespace, err)
		return
	}
	t.Logf("%s: MPS-lock policy refused a daemon on another node %v after the install", combo, time.Since(start).Round(time.Millisecond))

	accounts := []string{rbac.KubeletPluginAccount}
	if _, err := admin.CoreV1().ServiceAccounts(namespace).Get(ctx, rbac.ControllerAccount, metav1.GetOptions{}); err == nil {
		accounts = append(accounts, rbac.ControllerAccount)
	}
	type variant struct {
		name, want string
		mutate     func(*corev1.Pod)
	}
	variants := []variant{
		{"a service-account token", "without a token", func(p *corev1.Pod) { p.Spec.AutomountServiceAccountToken = ptr.To(true) }},
		{"a projected token volume", "mounts only host directories", func(p *corev1.Pod) {
			p.Spec.Volumes = append(p.Spec.Volumes, corev1.Volume{Name: "token", VolumeSource: corev1.VolumeSource{Projected: &corev1.ProjectedVolumeSource{
				Sources: []corev1.VolumeProjection{{ServiceAccountToken: &corev1.ServiceAccountTokenProjection{Path: "token"}}}}}})
			p.Spec.Containers[0].VolumeMounts = append(p.Spec.Containers[0].VolumeMounts, corev1.VolumeMount{Name: "token", MountPath: "/var/run/secrets/tokens"})
		}},
		{"another image", "runs the chart's MPS image", func(p *corev1.Pod) { p.Spec.Containers[0].Image = "docker.io/library/busybox:1.37" }},
		{"another command", "nvidia-cuda-mps-control -f", func(p *corev1.Pod) {
			p.Spec.Containers[0].Command = []string{"/driver-root/bin/sh", "-c", "cat /driver-root/etc/shadow"}
		}},
		{"a preloaded library", "nothing else", func(p *corev1.Pod) {
			p.Spec.Containers[0].Env = append(p.Spec.Containers[0].Env, corev1.EnvVar{Name: "LD_PRELOAD", Value: "/tmp/nvidia-mps/x.so"})
		}},
		{"a further host path", "mounts only host directories", func(p *corev1.Pod) {
			p.Spec.Volumes = append(p.Spec.Volumes, corev1.Volume{Name: "etc", VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: "/etc", Type: ptr.To(corev1.HostPathDirectory)}}})
			p.Spec.Containers[0].VolumeMounts = append(p.Spec.Containers[0].VolumeMounts, corev1.VolumeMount{Name: "etc", MountPath: "/host-etc"})
		}},
		{"a host path beside the claim's directories", "mounts only host directories", func(p *corev1.Pod) {
			p.Spec.Volumes[0].HostPath.Path = filepath.Join(o.PluginDataDir, "mps", "..", "checkpoint")
		}},
		{"a writable driver root", "driver root read-only", func(p *corev1.Pod) {
			for i, m := range p.Spec.Containers[0].VolumeMounts {
				if m.Name == "driver-root" {
					p.Spec.Containers[0].VolumeMounts[i].ReadOnly = false
				}
			}
		}},
		{"the host's PID namespace", "no host network, PID or IPC", func(p *corev1.Pod) { p.Spec.HostPID = true }},
		{"the host network", "no host network, PID or IPC", func(p *corev1.Pod) { p.Spec.HostNetwork = true }},
		{"an added capability", "added capabilities", func(p *corev1.Pod) {
			p.Spec.Containers[0].SecurityContext.Capabilities = &corev1.Capabilities{Add: []corev1.Capability{"SYS_ADMIN"}}
		}},
		{"a second container", "exactly one container", func(p *corev1.Pod) {
			extra := *p.Spec.Containers[0].DeepCopy()
			extra.Name = "second"
			p.Spec.Containers = append(p.Spec.Containers, extra)
		}},
	}
	for _, a := range accounts {
		variants = append(variants, variant{"service account " + a, "default service account", func(p *corev1.Pod) { p.Spec.ServiceAccountName = a }})
	}
	for i, v := range variants {
		p := daemonPod("node-a", 100+i)
		v.mutate(p)
		expectRefusal(t, fmt.Sprintf("%s: a daemon pod on node-a with %s", combo, v.name), create(p), v.want)
	}

	own := daemonPod("node-a", 2)
	if _, err := pods.Create(ctx, own, metav1.CreateOptions{}); err != nil {
		t.Errorf("%s: the plugin's account, bound to node-a, cannot create the MPS daemon pod driver/mps builds: %v", combo, err)
		return
	}
	theirs := daemonPod("node-b", 3)
	if _, err := admin.CoreV1().Pods(namespace).Create(ctx, theirs, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	expectRefusal(t, combo+": deleting node-b's daemon from node-a", pods.Delete(ctx, theirs.Name, metav1.DeleteOptions{}), "on its own node")
	if err := pods.Delete(ctx, own.Name, metav1.DeleteOptions{}); err != nil {
		t.Errorf("%s: the plugin's account cannot delete its own node's daemon pod: %v", combo, err)
	}
}

// forceDeletePods deletes the pods matching selector at once.
func forceDeletePods(ctx context.Context, t *testing.T, admin kubernetes.Interface, namespace, selector string) {
	t.Helper()
	err := admin.CoreV1().Pods(namespace).DeleteCollection(ctx, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}, metav1.ListOptions{LabelSelector: selector})
	if err != nil {
		t.Errorf("delete pods %s in %s: %v", selector, namespace, err)
	}
}
