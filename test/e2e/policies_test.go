package e2e

import (
	"context"
	"fmt"
	"maps"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"
	appsv1 "k8s.io/api/apps/v1"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/controller/gang"
	"github.com/tessera-dev/tessera/controller/nodelabels"
	"github.com/tessera-dev/tessera/deployments/helm"
	"github.com/tessera-dev/tessera/deployments/rbac"
	"github.com/tessera-dev/tessera/driver/daemonpod"
	gangdomain "github.com/tessera-dev/tessera/driver/domain"
	"github.com/tessera-dev/tessera/driver/imex"
	"github.com/tessera-dev/tessera/driver/mps"
	"github.com/tessera-dev/tessera/driver/plugin"
	"github.com/tessera-dev/tessera/driver/prepare"
	"github.com/tessera-dev/tessera/test/cluster"
)

// This file holds the checks TestHelmChartAppliesOnTheAPIServer runs after
// installing each values combination: what a node's token and the
// controller's token may write, with the chart's admission policies loaded
// on the real API server.

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
	if o.Node.HostDriverRoot != "" {
		root = o.Node.HostDriverRoot // daemon pods mount the host's path
	}
	if o.Node.FakeNode != "" {
		root = o.Node.FakeRoot // a fake node's driver lives there
	}
	daemonPod := func(node string, n int) *corev1.Pod {
		d := &mps.Daemons{Host: daemonpod.Host{Namespace: namespace, NodeName: node, Image: o.MPSImage, Dir: filepath.Join(o.PluginDataDir, "mps"), DriverRoot: root}}
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
		{"a library path of its own", "nothing else", func(p *corev1.Pod) {
			for i, e := range p.Spec.Containers[0].Env {
				if e.Name == "LD_LIBRARY_PATH" {
					p.Spec.Containers[0].Env[i].Value = "/driver-root/var/lib/kubelet/pods/0000/volumes/kubernetes.io~empty-dir/x"
				}
			}
		}},
		{"another claim's directories", "mounts only host directories", func(p *corev1.Pod) {
			p.Name = "tessera-mps-0f1e2d3c-0000-4000-8000-999999999999" // its volumes are still another claim's
		}},
		{"a further host path", "mounts only host directories", func(p *corev1.Pod) {
			p.Spec.Volumes = append(p.Spec.Volumes, corev1.Volume{Name: "etc", VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: "/etc", Type: ptr.To(corev1.HostPathDirectory)}}})
			p.Spec.Containers[0].VolumeMounts = append(p.Spec.Containers[0].VolumeMounts, corev1.VolumeMount{Name: "etc", MountPath: "/host-etc"})
		}},
		{"a host path beside the claim's directories", "mounts only host directories", func(p *corev1.Pod) {
			p.Spec.Volumes[0].HostPath.Path = filepath.Join(o.PluginDataDir, "mps", "..", "checkpoint")
		}},
		{"a subPath of the driver root over its binaries", "whole (no subPath)", func(p *corev1.Pod) {
			p.Spec.Containers[0].VolumeMounts = append(p.Spec.Containers[0].VolumeMounts, corev1.VolumeMount{Name: "driver-root", MountPath: "/driver-root/usr/bin", SubPath: "var/lib/kubelet/pods", ReadOnly: true})
		}},
		{"the driver root mounted elsewhere", "at their places", func(p *corev1.Pod) {
			for i, m := range p.Spec.Containers[0].VolumeMounts {
				if m.Name == "driver-root" {
					p.Spec.Containers[0].VolumeMounts[i].MountPath = "/tmp/nvidia-mps/root"
				}
			}
		}},
		{"a writable driver root", "driver-root /driver-root read-only", func(p *corev1.Pod) {
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

// checkControllerLock writes as the chart's tessera-controller service
// account in namespace, with the chart's controller policies loaded:
// releasing a gated gang member as controller/gang does (remove the gate
// gang.tessera.dev/placement, pin to a node, annotate) is accepted, while
// changing a member's image, removing another gate, adding a toleration or a
// label, or touching an ungated pod is refused; only node-less
// gpu.tessera.dev slices can be written (not another driver's, not a
// node's); and only claims annotated with their gang can be allocated, while
// annotating a claim with its gang is all the metadata it may change. Setting
// gang.tessera.dev/prepare-retry on a released member is accepted; with
// another annotation, or on a pod no gang placed, refused.
func checkControllerLock(ctx context.Context, t *testing.T, c *cluster.Cluster, combo, namespace string) {
	t.Helper()
	admin := c.Client()
	ctl := tokenClient(ctx, t, c, namespace, rbac.ControllerAccount, "")
	defer forceDeletePods(ctx, t, admin, namespace, "app=train")
	start := time.Now()

	// Pods.
	member := func(name string, gates ...string) *corev1.Pod {
		p := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace, Labels: map[string]string{"app": "train"}},
			Spec: corev1.PodSpec{
				Containers: []corev1.Container{{Name: "main", Image: "registry.example/train:1"}},
			},
		}
		for _, g := range append([]string{gangv1.SchedulingGate}, gates...) {
			p.Spec.SchedulingGates = append(p.Spec.SchedulingGates, corev1.PodSchedulingGate{Name: g})
		}
		created, err := admin.CoreV1().Pods(namespace).Create(ctx, p, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return created
	}
	release := func(p *corev1.Pod) *corev1.Pod {
		p = p.DeepCopy()
		if p.Annotations == nil {
			p.Annotations = map[string]string{}
		}
		p.Annotations[gangv1.AnnotationPlacement] = "p-1"
		p.Annotations[gangv1.AnnotationRank] = "0"
		p.Spec.Affinity = &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{
			NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchFields: []corev1.NodeSelectorRequirement{{Key: "metadata.name", Operator: corev1.NodeSelectorOpIn, Values: []string{"node-a"}}}}}}}}
		var kept []corev1.PodSchedulingGate
		for _, g := range p.Spec.SchedulingGates {
			if g.Name != gangv1.SchedulingGate {
				kept = append(kept, g)
			}
		}
		p.Spec.SchedulingGates = kept
		return p
	}
	update := func(p *corev1.Pod) error {
		_, err := ctl.CoreV1().Pods(namespace).Update(ctx, p, metav1.UpdateOptions{})
		return err
	}
	err := refusedOnceLoaded(ctx, func(n int) error {
		p := release(member(fmt.Sprintf("probe-%d", n)))
		p.Spec.Containers[0].Image = "registry.example/other:1"
		return update(p)
	}, func(int) {})
	if !expectRefusal(t, combo+": the controller releases a member with another image", err, "may not change a pod's containers (images)") {
		return
	}
	t.Logf("%s: controller policies refused an image change %v after the install", combo, time.Since(start).Round(time.Millisecond))

	if err := update(release(member("member-0"))); err != nil {
		t.Errorf("%s: the controller cannot release a gang member as controller/gang does: %v", combo, err)
	}
	p := release(member("member-5"))
	p.Annotations[gangv1.AnnotationRole] = "workers"
	p.Annotations[gangv1.AnnotationRoleRank] = "0"
	p.Annotations[gangv1.AnnotationRoleSize] = "1"
	if err := update(p); err != nil {
		t.Errorf("%s: the controller cannot release a member of a gang with roles as controller/gang does: %v", combo, err)
	}
	p = release(member("member-1", "example.com/other"))
	p.Spec.SchedulingGates = nil
	expectRefusal(t, combo+": the controller removes another gate", update(p), "no other gate")
	p = release(member("member-2"))
	p.Spec.Tolerations = append(p.Spec.Tolerations, corev1.Toleration{Operator: corev1.TolerationOpExists})
	expectRefusal(t, combo+": the controller adds a toleration", update(p), "tolerations")
	p = release(member("member-3"))
	p.Labels["app"] = "other"
	expectRefusal(t, combo+": the controller changes a label", update(p), "no other metadata")
	p = release(member("member-4"))
	p.Spec.Affinity.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms[0].MatchExpressions = []corev1.NodeSelectorRequirement{
		{Key: "example.com/pool", Operator: corev1.NodeSelectorOpIn, Values: []string{"a"}}}
	expectRefusal(t, combo+": the controller adds another node requirement", update(p), "pin a gang member to one node")
	released, err := admin.CoreV1().Pods(namespace).Get(ctx, "member-0", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	released.Annotations["example.com/note"] = "x"
	expectRefusal(t, combo+": the controller annotates an ungated pod", update(released), "may only release gang members")
	// Asking a released member's kubelet to prepare it again, as
	// controller/gang does (an update of one annotation).
	prepareAgain := func(name string, extra map[string]string) error {
		return retry.RetryOnConflict(retry.DefaultRetry, func() error {
			p, err := admin.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return err
			}
			if p.Annotations == nil {
				p.Annotations = map[string]string{}
			}
			p.Annotations[gangv1.AnnotationPrepareRetry] = time.Now().UTC().Format(time.RFC3339)
			maps.Copy(p.Annotations, extra)
			return update(p)
		})
	}
	if err := prepareAgain("member-0", nil); err != nil {
		t.Errorf("%s: the controller cannot ask a released member's kubelet to prepare it again as controller/gang does: %v", combo, err)
	}
	expectRefusal(t, combo+": the controller changes a released member's rank with its prepare-retry", prepareAgain("member-0", map[string]string{gangv1.AnnotationRank: "7"}), "may only release gang members")
	bystander, err := admin.CoreV1().Pods(namespace).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "bystander", Namespace: namespace, Labels: map[string]string{"app": "train"}},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "main", Image: "registry.example/web:1"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	expectRefusal(t, combo+": the controller sets prepare-retry on a pod no gang placed", prepareAgain(bystander.Name, nil), "may only release gang members")

	// Slices.
	slices := ctl.ResourceV1().ResourceSlices()
	slice := func(name, driver string, node *string) *resourceapi.ResourceSlice {
		pool := name
		if name == "domain" {
			pool = "domains/nvlink/" + combo // as controller/domains names its pools
		}
		s := &resourceapi.ResourceSlice{
			ObjectMeta: metav1.ObjectMeta{Name: combo + "-" + name},
			Spec: resourceapi.ResourceSliceSpec{Driver: driver, NodeName: node,
				Pool: resourceapi.ResourcePool{Name: pool, ResourceSliceCount: 1}, Devices: []resourceapi.Device{{Name: "channel-0"}}},
		}
		if node == nil {
			s.Spec.AllNodes = ptr.To(true)
		}
		return s
	}
	err = refusedOnceLoaded(ctx, func(int) error {
		_, err := slices.Create(ctx, slice("other", "other.example.com", nil), metav1.CreateOptions{})
		return err
	}, func(int) {
		_ = admin.ResourceV1().ResourceSlices().Delete(ctx, combo+"-other", metav1.DeleteOptions{})
	})
	if !expectRefusal(t, combo+": the controller writes another driver's slice", err, "node-less ResourceSlices of driver gpu.tessera.dev") {
		return
	}
	_, err = slices.Create(ctx, slice("node-a", driverName, ptr.To("node-a")), metav1.CreateOptions{})
	expectRefusal(t, combo+": the controller writes a node's slice", err, "node-less ResourceSlices of driver gpu.tessera.dev")
	// A node-less slice in a node's pool would stand in for the plugin's
	// own slices of that node.
	_, err = slices.Create(ctx, slice("node-a", driverName, nil), metav1.CreateOptions{})
	expectRefusal(t, combo+": the controller writes a node-less slice in a node's pool", err, "in its domain pools")
	nodeSlice, err := admin.ResourceV1().ResourceSlices().Create(ctx, slice("node-b", driverName, ptr.To("node-b")), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	expectRefusal(t, combo+": the controller deletes a node's slice", slices.Delete(ctx, nodeSlice.Name, metav1.DeleteOptions{}), "node-less ResourceSlices of driver gpu.tessera.dev")
	_ = admin.ResourceV1().ResourceSlices().Delete(ctx, nodeSlice.Name, metav1.DeleteOptions{})
	domain, err := slices.Create(ctx, slice("domain", driverName, nil), metav1.CreateOptions{})
	if err != nil {
		t.Errorf("%s: the controller cannot write a domain pool's slice: %v", combo, err)
	} else if err := slices.Delete(ctx, domain.Name, metav1.DeleteOptions{}); err != nil {
		t.Errorf("%s: the controller cannot delete a domain pool's slice: %v", combo, err)
	}

	// Reservations' DeviceTaintRules.
	rules := ctl.ResourceV1().DeviceTaintRules()
	rule := func(name, pool string, effect resourceapi.DeviceTaintEffect, labelled bool) *resourceapi.DeviceTaintRule {
		r := &resourceapi.DeviceTaintRule{
			ObjectMeta: metav1.ObjectMeta{Name: "tessera-reserve-" + combo + "-" + name},
			Spec: resourceapi.DeviceTaintRuleSpec{
				DeviceSelector: &resourceapi.DeviceTaintSelector{Driver: ptr.To(driverName), Pool: ptr.To(pool)},
				Taint:          resourceapi.DeviceTaint{Key: gangv1.TaintReserved, Value: "uid-1", Effect: effect},
			},
		}
		if labelled {
			r.Labels = map[string]string{gangv1.LabelReservation: "uid-1"}
		}
		return r
	}
	err = refusedOnceLoaded(ctx, func(int) error {
		_, err := rules.Create(ctx, rule("evict", "node-a", resourceapi.DeviceTaintEffectNoExecute, true), metav1.CreateOptions{})
		return err
	}, func(int) {
		_ = admin.ResourceV1().DeviceTaintRules().Delete(ctx, "tessera-reserve-"+combo+"-evict", metav1.DeleteOptions{})
	})
	if !expectRefusal(t, combo+": the controller writes a NoExecute taint", err, "DeviceTaintRules of its reservations") {
		return
	}
	_, err = rules.Create(ctx, rule("unlabelled", "node-a", resourceapi.DeviceTaintEffectNoSchedule, false), metav1.CreateOptions{})
	expectRefusal(t, combo+": the controller writes a rule of no reservation", err, "DeviceTaintRules of its reservations")
	_, err = rules.Create(ctx, rule("domain", "domains/nvlink/x", resourceapi.DeviceTaintEffectNoSchedule, true), metav1.CreateOptions{})
	expectRefusal(t, combo+": the controller taints a domain pool", err, "DeviceTaintRules of its reservations")
	mislabelled := rule("mislabelled", "node-a", resourceapi.DeviceTaintEffectNoSchedule, true)
	mislabelled.Spec.Taint.Value = "uid-2"
	_, err = rules.Create(ctx, mislabelled, metav1.CreateOptions{})
	expectRefusal(t, combo+": the controller writes a rule whose label is not its taint's gang", err, "DeviceTaintRules of its reservations")
	others, err := admin.ResourceV1().DeviceTaintRules().Create(ctx, rule("admins", "node-b", resourceapi.DeviceTaintEffectNoExecute, false), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	expectRefusal(t, combo+": the controller deletes an administrator's rule", rules.Delete(ctx, others.Name, metav1.DeleteOptions{}), "DeviceTaintRules of its reservations")
	_ = admin.ResourceV1().DeviceTaintRules().Delete(ctx, others.Name, metav1.DeleteOptions{})
	if r, err := rules.Create(ctx, rule("reserve", "node-a", resourceapi.DeviceTaintEffectNoSchedule, true), metav1.CreateOptions{}); err != nil {
		t.Errorf("%s: the controller cannot reserve a node pool as controller/gang does: %v", combo, err)
	} else if err := rules.Delete(ctx, r.Name, metav1.DeleteOptions{}); err != nil {
		t.Errorf("%s: the controller cannot delete its reservation's rule: %v", combo, err)
	}

	// Nodes: their NVLink labels (controller/nodelabels), nothing else.
	node, err := admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "policy-node-" + combo, Labels: map[string]string{"team": "ml"}}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = admin.CoreV1().Nodes().Delete(ctx, node.Name, metav1.DeleteOptions{}) }()
	patchNode := func(patch string) error {
		_, err := ctl.CoreV1().Nodes().Patch(ctx, node.Name, types.MergePatchType, []byte(patch), metav1.PatchOptions{})
		return err
	}
	err = refusedOnceLoaded(ctx, func(int) error { return patchNode(`{"metadata":{"labels":{"team":"ops"}}}`) }, func(int) {
		_ = patchNode(`{"metadata":{"labels":{"team":"ml"}}}`) // as the admin had it; refused once loaded
	})
	if !expectRefusal(t, combo+": the controller changes another label of a node", err, "may only set and remove a Node's labels") {
		return
	}
	expectRefusal(t, combo+": the controller taints a node", patchNode(`{"spec":{"taints":[{"key":"x","effect":"NoSchedule"}]}}`), "may only set and remove a Node's labels")
	expectRefusal(t, combo+": the controller annotates a node", patchNode(`{"metadata":{"annotations":{"x":"y"}}}`), "may only set and remove a Node's labels")
	if err := patchNode(`{"metadata":{"labels":{"` + nodelabels.LabelClique + `":"dom.1","` + nodelabels.LabelDomain + `":"dom"}}}`); err != nil {
		t.Errorf("%s: the controller cannot label a node with its NVLink clique as controller/nodelabels does: %v", combo, err)
	} else if err := patchNode(`{"metadata":{"labels":{"` + nodelabels.LabelClique + `":null,"` + nodelabels.LabelDomain + `":null}}}`); err != nil {
		t.Errorf("%s: the controller cannot remove a node's NVLink labels: %v", combo, err)
	}

	// Claims.
	claims := ctl.ResourceV1().ResourceClaims(namespace)
	claim, err := admin.ResourceV1().ResourceClaims(namespace).Create(ctx, &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "member-0-gpu", Namespace: namespace},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
			Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: driverName}}}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { // without its finalizer, so that the namespace can go
		if c, err := admin.ResourceV1().ResourceClaims(namespace).Get(ctx, claim.Name, metav1.GetOptions{}); err == nil {
			c.Finalizers = nil
			_, _ = admin.ResourceV1().ResourceClaims(namespace).Update(ctx, c, metav1.UpdateOptions{})
		}
	}()
	allocate := func(c *resourceapi.ResourceClaim) *resourceapi.ResourceClaim {
		c = c.DeepCopy()
		c.Status.Allocation = &resourceapi.AllocationResult{
			Devices:             resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{{Request: "gpu", Driver: driverName, Pool: "node-a", Device: "gpu-0"}}},
			AllocationTimestamp: &metav1.Time{Time: time.Now()},
		}
		return c
	}
	err = refusedOnceLoaded(ctx, func(int) error {
		_, err := claims.UpdateStatus(ctx, allocate(claim), metav1.UpdateOptions{})
		return err
	}, func(int) {
		fresh, err := admin.ResourceV1().ResourceClaims(namespace).Get(ctx, claim.Name, metav1.GetOptions{})
		if err == nil {
			fresh.Status.Allocation = nil
			claim, _ = admin.ResourceV1().ResourceClaims(namespace).UpdateStatus(ctx, fresh, metav1.UpdateOptions{})
		}
	})
	if !expectRefusal(t, combo+": the controller allocates a claim of no gang", err, "claims of the gangs it places") {
		return
	}
	labelled := claim.DeepCopy()
	labelled.Labels = map[string]string{"example.com/x": "y"}
	_, err = claims.Update(ctx, labelled, metav1.UpdateOptions{})
	expectRefusal(t, combo+": the controller labels a claim", err, "may only annotate a claim with its gang")
	annotated := claim.DeepCopy()
	// A member of a gang with roles carries its role too.
	annotated.Annotations = map[string]string{gangv1.AnnotationGang: namespace + "/train", gangv1.AnnotationSize: "1", gangv1.AnnotationPlacement: "p-1", gangv1.AnnotationRank: "0",
		gangv1.AnnotationRole: "workers", gangv1.AnnotationRoleRank: "0", gangv1.AnnotationRoleSize: "1", gangv1.AnnotationNode: "node-a"}
	annotated.Finalizers = append(annotated.Finalizers, "resource.kubernetes.io/delete-protection")
	if annotated, err = claims.Update(ctx, annotated, metav1.UpdateOptions{}); err != nil {
		t.Errorf("%s: the controller cannot annotate a claim with its gang as controller/gang does: %v", combo, err)
		return
	}
	// A member's own claim is the scheduler's to allocate, even annotated.
	_, err = claims.UpdateStatus(ctx, allocate(annotated), metav1.UpdateOptions{})
	expectRefusal(t, combo+": the controller allocates a GPU to its gang's member", err, "may only write the allocation of a domain claim")
	// A domain channel, with its binding conditions.
	channelOn := func(c *resourceapi.ResourceClaim, request string) *resourceapi.ResourceClaim {
		c = allocate(c)
		res := &c.Status.Allocation.Devices.Results[0]
		res.Request, res.Pool, res.Device = request, "domains/nvlink/clique-a", "channel-0"
		res.BindingConditions = []string{gangdomain.ConditionMembersAllocated}
		res.BindingFailureConditions = []string{gangdomain.ConditionPlacementFailed}
		return c
	}
	// Nor can it take the claim over with a channel: its token writes the
	// status of domain claims only, whatever the annotations say.
	_, err = claims.UpdateStatus(ctx, channelOn(annotated, "gpu"), metav1.UpdateOptions{})
	expectRefusal(t, combo+": the controller puts a channel on a claim that asks for a GPU", err, "may only write the status of a domain claim")
	// Its gang's domain claim: allocated, its binding conditions' status
	// set (the synthetic resourceclaims/driver right), then cleared.
	dc, err := admin.ResourceV1().ResourceClaims(namespace).Create(ctx, &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "train-domain", Namespace: namespace},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
			Name: "domain", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: gangv1.DomainClass}}}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	dc.Annotations = map[string]string{gangv1.AnnotationGang: namespace + "/train", gangv1.AnnotationPlacement: "p-1", gangv1.AnnotationNodes: "node-a"}
	if dc, err = claims.Update(ctx, dc, metav1.UpdateOptions{}); err != nil {
		t.Errorf("%s: the controller cannot annotate its gang's domain claim as controller/gang does: %v", combo, err)
		return
	}
	allocated, err := claims.UpdateStatus(ctx, channelOn(dc, "domain"), metav1.UpdateOptions{})
	if err != nil {
		t.Errorf("%s: the controller cannot allocate its gang's domain channel: %v", combo, err)
		return
	}
	allocated.Status.Devices = []resourceapi.AllocatedDeviceStatus{{Driver: driverName, Pool: "domains/nvlink/clique-a", Device: "channel-0",
		Conditions: []metav1.Condition{{Type: gangdomain.ConditionMembersAllocated, Status: metav1.ConditionTrue, Reason: "MembersAllocated", LastTransitionTime: metav1.Now()}}}}
	if allocated, err = claims.UpdateStatus(ctx, allocated, metav1.UpdateOptions{}); err != nil {
		t.Errorf("%s: the controller cannot let its gang's members bind: %v", combo, err)
		return
	}
	allocated.Status.Allocation = nil
	allocated.Status.Devices = nil
	if _, err := claims.UpdateStatus(ctx, allocated, metav1.UpdateOptions{}); err != nil {
		t.Errorf("%s: the controller cannot clear its gang's domain claim: %v", combo, err)
	}
}

// checkDomainChannels holds the tessera-domain-channels policy: no claim
// or claim template, whoever writes it (a cluster administrator here),
// tolerates the taint that keeps the scheduler from allocating domain
// channels, by its key or by a toleration without a key; other
// tolerations pass.
func checkDomainChannels(ctx context.Context, t *testing.T, c *cluster.Cluster, combo, namespace string) {
	t.Helper()
	admin := c.Client()
	request := func(tol resourceapi.DeviceToleration) resourceapi.DeviceRequest {
		return resourceapi.DeviceRequest{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: driverName, Tolerations: []resourceapi.DeviceToleration{tol}}}
	}
	claimWith := func(name string, r resourceapi.DeviceRequest) *resourceapi.ResourceClaim {
		return &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace},
			Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{r}}}}
	}
	fenced := resourceapi.DeviceToleration{Key: gangdomain.TaintKey, Operator: resourceapi.DeviceTolerationOpExists}
	everything := resourceapi.DeviceToleration{Operator: resourceapi.DeviceTolerationOpExists}
	claims := admin.ResourceV1().ResourceClaims(namespace)
	err := refusedOnceLoaded(ctx, func(i int) error {
		_, err := claims.Create(ctx, claimWith(fmt.Sprintf("fenced-%d", i), request(fenced)), metav1.CreateOptions{})
		return err
	}, func(i int) { _ = claims.Delete(ctx, fmt.Sprintf("fenced-%d", i), metav1.DeleteOptions{}) })
	if !expectRefusal(t, combo+": a claim tolerates the domain channels' taint", err, "only tessera-controller allocates") {
		return
	}
	_, err = claims.Create(ctx, claimWith("everything", request(everything)), metav1.CreateOptions{})
	expectRefusal(t, combo+": a claim tolerates every taint", err, "only tessera-controller allocates")
	sub := resourceapi.DeviceRequest{Name: "gpu", FirstAvailable: []resourceapi.DeviceSubRequest{
		{Name: "big", DeviceClassName: driverName},
		{Name: "channel", DeviceClassName: driverName, Tolerations: []resourceapi.DeviceToleration{fenced}},
	}}
	_, err = claims.Create(ctx, claimWith("subrequest", sub), metav1.CreateOptions{})
	expectRefusal(t, combo+": a claim's subrequest tolerates the taint", err, "only tessera-controller allocates")
	_, err = admin.ResourceV1().ResourceClaimTemplates(namespace).Create(ctx, &resourceapi.ResourceClaimTemplate{
		ObjectMeta: metav1.ObjectMeta{Name: "fenced", Namespace: namespace},
		Spec:       resourceapi.ResourceClaimTemplateSpec{Spec: claimWith("", request(fenced)).Spec},
	}, metav1.CreateOptions{})
	expectRefusal(t, combo+": a claim template tolerates the taint", err, "only tessera-controller allocates")
	backfill := resourceapi.DeviceToleration{Key: gangv1.TaintReserved, Operator: resourceapi.DeviceTolerationOpExists}
	if _, err := claims.Create(ctx, claimWith("backfill", request(backfill)), metav1.CreateOptions{}); err != nil {
		t.Errorf("%s: a claim tolerating a reservation (backfill) is refused: %v", combo, err)
	} else {
		_ = claims.Delete(ctx, "backfill", metav1.DeleteOptions{})
	}
}

// rendersController reports whether the rendered chart runs tessera-controller.
func rendersController(t *testing.T, manifests []helm.Manifest) bool {
	t.Helper()
	for _, m := range manifests {
		if m.Kind != "Deployment" {
			continue
		}
		var d metav1.PartialObjectMetadata
		if err := yaml.Unmarshal([]byte(m.YAML), &d); err != nil {
			t.Fatalf("%s: %v", m.Source, err)
		}
		if d.Name == "tessera-controller" {
			return true
		}
	}
	return false
}

// forceDeletePods deletes the pods matching selector at once.
func forceDeletePods(ctx context.Context, t *testing.T, admin kubernetes.Interface, namespace, selector string) {
	t.Helper()
	err := admin.CoreV1().Pods(namespace).DeleteCollection(ctx, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}, metav1.ListOptions{LabelSelector: selector})
	if err != nil {
		t.Errorf("delete pods %s in %s: %v", selector, namespace, err)
	}
}

// checkIMEXLock creates IMEX daemon pods as the chart's kubelet-plugin
// service account in namespace, with a token bound to node-a, as the
// plugin does for a gang's NVLink domain claim (driver/imex). The pod built
// from the DaemonSet's own flags (image, data directory, driver root, port)
// is accepted and can be deleted; the same pod on node-b, with a token,
// another image, command or port, an extra host port, the host's PID
// namespace, a further host path or another claim's directory, a writable
// configuration, an exec readiness probe or a preloaded library is refused
// by the chart's IMEX-lock policy, and so is deleting node-b's daemon. A pod
// labelled as an IMEX daemon cannot dodge the policies by its label: one
// shaped like an MPS daemon but labelled tessera-imex is refused too.
func checkIMEXLock(ctx context.Context, t *testing.T, c *cluster.Cluster, combo, namespace string, manifests []helm.Manifest) {
	t.Helper()
	admin := c.Client()
	o := pluginOptions(t, combo, manifests)
	if o.IMEXImage == "" {
		t.Errorf("%s: the DaemonSet runs no IMEX daemons (no --imex-image), though kubeletPlugin.imex.enabled defaults to true", combo)
		return
	}
	root := o.Node.DriverRoot
	if o.Node.HostDriverRoot != "" {
		root = o.Node.HostDriverRoot
	}
	if o.Node.FakeNode != "" {
		root = o.Node.FakeRoot
	}
	daemonPod := func(node string, n int) *corev1.Pod {
		d := &imex.Daemons{Host: daemonpod.Host{Namespace: namespace, NodeName: node, Image: o.IMEXImage, Dir: filepath.Join(o.PluginDataDir, "imex"), DriverRoot: root}, Port: o.IMEXPort}
		uid := fmt.Sprintf("0f1e2d3c-0000-4000-9000-%012d", n)
		return d.Pod(prepare.IMEXDaemon{Daemon: d.Locate(uid), ClaimUID: uid, ClaimNamespace: "default", ClaimName: "train-domain"}, "10.0.0.1,10.0.0.2")
	}
	if err := c.CreateNamespace(ctx, namespace); err != nil {
		t.Fatal(err)
	}
	pods := tokenClient(ctx, t, c, namespace, rbac.KubeletPluginAccount, "node-a").CoreV1().Pods(namespace)
	defer forceDeletePods(ctx, t, admin, namespace, daemonpod.LabelApp+"="+imex.AppName)
	create := func(p *corev1.Pod) error {
		_, err := pods.Create(ctx, p, metav1.CreateOptions{})
		if err == nil {
			_ = admin.CoreV1().Pods(namespace).Delete(ctx, p.Name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)})
		}
		return err
	}
	err := refusedOnceLoaded(ctx, func(int) error {
		_, err := pods.Create(ctx, daemonPod("node-b", 1), metav1.CreateOptions{})
		return err
	}, func(int) {
		_ = admin.CoreV1().Pods(namespace).Delete(ctx, daemonPod("node-b", 1).Name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)})
	})
	if !strings.Contains(fmt.Sprint(err), "may only run and delete IMEX daemon pods on its own node") {
		t.Errorf("%s: the plugin's account in %s, bound to node-a, ran an IMEX daemon pod on node-b or was refused for another reason: %v", combo, namespace, err)
		return
	}
	port := int32(o.IMEXPort)
	variants := []struct {
		name, want string
		mutate     func(*corev1.Pod)
	}{
		{"a service-account token", "without a token", func(p *corev1.Pod) { p.Spec.AutomountServiceAccountToken = ptr.To(true) }},
		{"another image", "runs the chart's IMEX image", func(p *corev1.Pod) { p.Spec.Containers[0].Image = "docker.io/library/busybox:1.37" }},
		{"another command", "nvidia-imex -c", func(p *corev1.Pod) {
			p.Spec.Containers[0].Command = []string{"/driver-root/bin/sh", "-c", "cat /driver-root/etc/shadow"}
		}},
		{"an exec readiness probe", "nvidia-imex -c", func(p *corev1.Pod) {
			p.Spec.Containers[0].ReadinessProbe.ProbeHandler = corev1.ProbeHandler{Exec: &corev1.ExecAction{Command: []string{"/bin/sh"}}}
		}},
		{"a preloaded library", "nvidia-imex -c", func(p *corev1.Pod) {
			p.Spec.Containers[0].Env = append(p.Spec.Containers[0].Env, corev1.EnvVar{Name: "LD_PRELOAD", Value: "/etc/nvidia-imex/x.so"})
		}},
		{"another port", "its one port", func(p *corev1.Pod) {
			p.Spec.Containers[0].Ports[0].HostPort = 22
			p.Spec.Containers[0].Ports[0].ContainerPort = 22
		}},
		{"a second host port", "its one port", func(p *corev1.Pod) {
			p.Spec.Containers[0].Ports = append(p.Spec.Containers[0].Ports, corev1.ContainerPort{ContainerPort: 2379, HostPort: 2379})
		}},
		{"the host's PID namespace", "no PID or IPC namespace", func(p *corev1.Pod) { p.Spec.HostPID = true }},
		{"another claim's directory", "exactly two volumes", func(p *corev1.Pod) {
			p.Name = "tessera-imex-0f1e2d3c-0000-4000-9000-999999999999-node-a"
			p.Labels[daemonpod.LabelClaimUID] = "0f1e2d3c-0000-4000-9000-999999999999"
		}},
		{"a further host path", "exactly two volumes", func(p *corev1.Pod) {
			p.Spec.Volumes = append(p.Spec.Volumes, corev1.Volume{Name: "etc", VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: "/etc", Type: ptr.To(corev1.HostPathDirectory)}}})
			p.Spec.Containers[0].VolumeMounts = append(p.Spec.Containers[0].VolumeMounts, corev1.VolumeMount{Name: "etc", MountPath: "/host-etc", ReadOnly: true})
		}},
		{"a writable configuration", "read-only", func(p *corev1.Pod) { p.Spec.Containers[0].VolumeMounts[0].ReadOnly = false }},
		{"a subPath of the driver root over its binaries", "whole (no subPath)", func(p *corev1.Pod) {
			p.Spec.Containers[0].VolumeMounts = append(p.Spec.Containers[0].VolumeMounts, corev1.VolumeMount{Name: "driver-root", MountPath: "/driver-root/usr/bin", SubPath: "var/lib/kubelet/pods", ReadOnly: true})
		}},
		{"a name of no claim", "is named tessera-imex-<claim UID>-<node>", func(p *corev1.Pod) { p.Name = "tessera-imex-x-node-a" }},
		{"another node's label", "is named tessera-imex-<claim UID>-<node>", func(p *corev1.Pod) { p.Labels[daemonpod.LabelNode] = "node-b" }},
		{"an MPS daemon's shape", "nvidia-imex -c", func(p *corev1.Pod) {
			p.Spec.Containers[0].Command = []string{"/driver-root/usr/bin/nvidia-cuda-mps-control", "-f"}
		}},
	}
	for i, v := range variants {
		p := daemonPod("node-a", 100+i)
		v.mutate(p)
		expectRefusal(t, fmt.Sprintf("%s: an IMEX daemon pod on node-a with %s", combo, v.name), create(p), v.want)
	}
	own := daemonPod("node-a", 2)
	if own.Spec.Containers[0].Ports[0].HostPort != port {
		t.Fatalf("%s: driver/imex built a pod with host port %d, the DaemonSet says %d", combo, own.Spec.Containers[0].Ports[0].HostPort, port)
	}
	if _, err := pods.Create(ctx, own, metav1.CreateOptions{}); err != nil {
		t.Errorf("%s: the plugin's account, bound to node-a, cannot create the IMEX daemon pod driver/imex builds: %v", combo, err)
		return
	}
	theirs := daemonPod("node-b", 3)
	if _, err := admin.CoreV1().Pods(namespace).Create(ctx, theirs, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	expectRefusal(t, combo+": deleting node-b's IMEX daemon from node-a", pods.Delete(ctx, theirs.Name, metav1.DeleteOptions{}), "on its own node")
	if err := pods.Delete(ctx, own.Name, metav1.DeleteOptions{}); err != nil {
		t.Errorf("%s: the plugin's account cannot delete its own node's IMEX daemon pod: %v", combo, err)
	}
}

// checkGangAnnotations writes as a tenant who may create and update claims,
// pods and gangs in namespace, with the chart's tessera-gang-annotations
// policy loaded: a claim or pod created with an annotation the controller
// writes (a domain claim's nodes, a member's placement), a claim updated to
// add one (a rank, a growth's attempt), a placed member's placement removed,
// a rank added through a pod's status or binding, or a gang created or
// updated with a record of a placement (which the controller trusts to roll
// claims back), is refused naming the annotation; other annotations are the
// tenant's to write; a cluster administrator is let through.
func checkGangAnnotations(ctx context.Context, t *testing.T, c *cluster.Cluster, combo, namespace string) {
	t.Helper()
	admin := c.Client()
	const tenant = "tenant-a"
	_, err := admin.RbacV1().Roles(namespace).Create(ctx, &rbacv1.Role{
		ObjectMeta: metav1.ObjectMeta{Name: tenant},
		Rules: []rbacv1.PolicyRule{{APIGroups: []string{"", "resource.k8s.io", gangv1.Group}, Resources: []string{"pods", "pods/status", "pods/binding", "resourceclaims", "gangs"},
			Verbs: []string{"get", "create", "update", "delete"}}},
	}, metav1.CreateOptions{})
	noErr(t, err)
	_, err = admin.RbacV1().RoleBindings(namespace).Create(ctx, &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: tenant},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: tenant},
		Subjects:   []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.UserKind, Name: tenant}},
	}, metav1.CreateOptions{})
	noErr(t, err)
	cfg := rest.CopyConfig(c.RESTConfig())
	cfg.Impersonate = rest.ImpersonationConfig{UserName: tenant, Groups: []string{"system:authenticated"}}
	user, err := kubernetes.NewForConfig(cfg)
	noErr(t, err)
	claim := func(name string, annotations map[string]string) *resourceapi.ResourceClaim {
		return &resourceapi.ResourceClaim{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace, Annotations: annotations},
			Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
				Name: "channel", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "domain.gpu.tessera.dev"}}}}},
		}
	}
	claims := user.ResourceV1().ResourceClaims(namespace)
	// The tenant's role takes effect once the API server's authorizer has
	// seen it: until its own claim is accepted, a refusal says nothing.
	var own *resourceapi.ResourceClaim
	err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		own, err = claims.Create(ctx, claim("own", map[string]string{"example.com/team": "vision"}), metav1.CreateOptions{})
		return err == nil, nil
	})
	if err != nil {
		t.Fatalf("%s: a tenant cannot create a claim with an annotation of its own: %v", combo, err)
	}
	start := time.Now()
	err = refusedOnceLoaded(ctx, func(n int) error {
		_, err := claims.Create(ctx, claim(fmt.Sprintf("forged-%d", n), map[string]string{gangv1.AnnotationNodes: "node-a=192.0.2.1,node-b=198.51.100.7"}), metav1.CreateOptions{})
		return err
	}, func(n int) {
		_ = admin.ResourceV1().ResourceClaims(namespace).Delete(ctx, fmt.Sprintf("forged-%d", n), metav1.DeleteOptions{})
	})
	if !expectRefusal(t, combo+": a tenant creates a domain claim listing the IMEX nodes", err, "annotations gang.tessera.dev/nodes are written by tessera-controller only") {
		return
	}
	t.Logf("%s: gang-annotations policy refused a tenant's forged nodes %v after the install", combo, time.Since(start).Round(time.Millisecond))

	ranked := own.DeepCopy()
	ranked.Annotations[gangv1.AnnotationRank] = "0"
	_, err = claims.Update(ctx, ranked, metav1.UpdateOptions{})
	expectRefusal(t, combo+": a tenant gives its claim a rank", err, "annotations gang.tessera.dev/rank are written by tessera-controller only")
	grown := own.DeepCopy()
	grown.Annotations[gangv1.AnnotationGrowth] = "a1b2c3d4"
	_, err = claims.Update(ctx, grown, metav1.UpdateOptions{})
	expectRefusal(t, combo+": a tenant marks its claim as an elastic gang's growth", err, "annotations gang.tessera.dev/growth are written by tessera-controller only")
	noted := own.DeepCopy()
	noted.Annotations["example.com/team"] = "speech"
	if _, err := claims.Update(ctx, noted, metav1.UpdateOptions{}); err != nil {
		t.Errorf("%s: a tenant cannot change its own annotation on its claim: %v", combo, err)
	}
	checkGangRecords(ctx, t, c, combo, namespace, cfg)
	_, err = user.CoreV1().Pods(namespace).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "forged-member", Namespace: namespace,
			Annotations: map[string]string{gangv1.AnnotationPlacement: "p-1", gangv1.AnnotationRank: "0"}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "main", Image: "registry.example/train:1"}}},
	}, metav1.CreateOptions{})
	expectRefusal(t, combo+": a tenant creates a pod with a member's placement and rank", err, "are written by tessera-controller only")
	// A member the controller placed (made here by the administrator):
	// the tenant may not strip its placement, nor add a rank through its
	// status or through a binding, which copies its annotations onto the
	// pod.
	placed, err := admin.CoreV1().Pods(namespace).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "placed-member", Namespace: namespace, Labels: map[string]string{"app": "train"},
			Annotations: map[string]string{gangv1.AnnotationPlacement: "p-1"}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "main", Image: "registry.example/train:1"}}},
	}, metav1.CreateOptions{})
	noErr(t, err)
	defer forceDeletePods(ctx, t, admin, namespace, "app=train")
	// The scheduler writes the pod's status meanwhile: each write starts
	// from the pod as it is.
	fresh := func() *corev1.Pod {
		p, err := admin.CoreV1().Pods(namespace).Get(ctx, placed.Name, metav1.GetOptions{})
		noErr(t, err)
		return p
	}
	err = retry.OnError(retry.DefaultRetry, apierrors.IsConflict, func() error {
		stripped := fresh()
		delete(stripped.Annotations, gangv1.AnnotationPlacement)
		_, err := user.CoreV1().Pods(namespace).Update(ctx, stripped, metav1.UpdateOptions{})
		return err
	})
	expectRefusal(t, combo+": a tenant removes a member's placement", err, "annotations gang.tessera.dev/placement are written by tessera-controller only")
	err = retry.OnError(retry.DefaultRetry, apierrors.IsConflict, func() error {
		ranked2 := fresh()
		ranked2.Annotations[gangv1.AnnotationRank] = "0"
		_, err := user.CoreV1().Pods(namespace).UpdateStatus(ctx, ranked2, metav1.UpdateOptions{})
		return err
	})
	expectRefusal(t, combo+": a tenant adds a rank through a pod's status", err, "annotations gang.tessera.dev/rank are written by tessera-controller only")
	err = user.CoreV1().Pods(namespace).Bind(ctx, &corev1.Binding{
		ObjectMeta: metav1.ObjectMeta{Name: placed.Name, Annotations: map[string]string{gangv1.AnnotationRank: "0"}},
		Target:     corev1.ObjectReference{Kind: "Node", Name: "node-a"},
	}, metav1.CreateOptions{})
	expectRefusal(t, combo+": a tenant binds a member with a rank", err, "annotations gang.tessera.dev/rank are written by tessera-controller only (a gang member's placement, rank and role, a domain claim's nodes): remove them from the binding")
	byAdmin, err := admin.ResourceV1().ResourceClaims(namespace).Create(ctx, claim("restored", map[string]string{gangv1.AnnotationRank: "3"}), metav1.CreateOptions{})
	if err != nil {
		t.Errorf("%s: a cluster administrator cannot create a claim with a rank (a restore): %v", combo, err)
	} else {
		_ = admin.ResourceV1().ResourceClaims(namespace).Delete(ctx, byAdmin.Name, metav1.DeleteOptions{})
	}
	_ = admin.ResourceV1().ResourceClaims(namespace).Delete(ctx, own.Name, metav1.DeleteOptions{})
}

// checkGangRecords is checkGangAnnotations' part for gangs, as the tenant
// cfg impersonates: it may create its gang and change its own annotation on
// it, but not record a placement on it (the controller would roll back the
// claims the record names, another gang's running ones included), nor
// create a gang that claims a committed placement.
func checkGangRecords(ctx context.Context, t *testing.T, c *cluster.Cluster, combo, namespace string, cfg *rest.Config) {
	t.Helper()
	dyn, err := dynamic.NewForConfig(cfg)
	noErr(t, err)
	admin, err := dynamic.NewForConfig(c.RESTConfig())
	noErr(t, err)
	gangs := gang.NewClient(dyn)
	newGang := func(name string, annotations map[string]string) *gangv1.Gang {
		return &gangv1.Gang{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace, Annotations: annotations},
			Spec: gangv1.GangSpec{Size: 2, DomainClaimName: name + "-domain",
				Selector: metav1.LabelSelector{MatchLabels: map[string]string{"gang": name}}},
		}
	}
	// The chart's CRD may not serve gangs yet.
	var own *gangv1.Gang
	err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		own, err = gangs.Create(ctx, newGang("own", map[string]string{"example.com/team": "vision"}))
		return err == nil, nil
	})
	if err != nil {
		t.Errorf("%s: a tenant cannot create a gang with an annotation of its own: %v", combo, err)
		return
	}
	defer func() {
		_ = admin.Resource(gangv1.GroupVersionResource).Namespace(namespace).Delete(ctx, own.Name, metav1.DeleteOptions{})
	}()
	forged := own.DeepCopy()
	forged.Annotations[gangv1.AnnotationUncommitted] = `{"placement":"a1b2c3d4","claims":["other-gang-domain"]}`
	_, err = gangs.Update(ctx, forged)
	expectRefusal(t, combo+": a tenant records a placement on its gang", err, "annotations gang.tessera.dev/uncommitted-placement are written by tessera-controller only (its records of a gang's placements, from which it rolls claims back)")
	_, err = gangs.Create(ctx, newGang("committed", map[string]string{gangv1.AnnotationCommitted: "a1b2c3d4"}))
	expectRefusal(t, combo+": a tenant creates a gang with a committed placement", err, "annotations gang.tessera.dev/committed-placement are written by tessera-controller only")
	noted := own.DeepCopy()
	noted.Annotations["example.com/team"] = "speech"
	if _, err := gangs.Update(ctx, noted); err != nil {
		t.Errorf("%s: a tenant cannot change its own annotation on its gang: %v", combo, err)
	}
}
