package helm

import (
	"context"
	"fmt"
	"maps"
	"net"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/spf13/pflag"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/tessera-dev/tessera/component"
	"github.com/tessera-dev/tessera/controller"
	"github.com/tessera-dev/tessera/driver/plugin"
	"github.com/tessera-dev/tessera/webhook"
)

// TestNodeLockMatchesThePluginsServiceAccount: in every combination each
// admission policy matches exactly the user its component's pods run as
// (the service account in the release namespace): the node-lock, MPS-lock
// and IMEX-lock policies the DaemonSet's, the controller's policies the controller
// Deployment's (rendered only with it); each is bound to deny; and the
// accounts exist and are bound to their roles. A policy that names another
// account never applies, and nothing would notice (the NVIDIA chart's #1317).
func TestNodeLockMatchesThePluginsServiceAccount(t *testing.T) {
	for _, c := range Combinations() {
		r := renderT(t, c)
		ds := one(t, c.Name, find[*appsv1.DaemonSet](r))
		pluginUser := serviceAccountUser(ds.Namespace, ds.Spec.Template.Spec.ServiceAccountName)
		want := map[string]string{ // policy -> user it must match
			"tessera-kubelet-plugin-node-lock": pluginUser,
			"tessera-kubelet-plugin-mps-lock":  pluginUser,
			"tessera-kubelet-plugin-imex-lock": pluginUser,
		}
		checkAccountBound(t, c.Name, r, ds.Namespace, ds.Spec.Template.Spec.ServiceAccountName, "tessera-kubelet-plugin", "tessera-kubelet-plugin-mps")
		for _, d := range find[*appsv1.Deployment](r) {
			if d.Name == "tessera-controller" {
				checkAccountBound(t, c.Name, r, d.Namespace, d.Spec.Template.Spec.ServiceAccountName, "tessera-controller", "tessera-controller-leader")
				user := serviceAccountUser(d.Namespace, d.Spec.Template.Spec.ServiceAccountName)
				for _, p := range []string{"tessera-controller-pods", "tessera-controller-claims", "tessera-controller-slices", "tessera-controller-reservations", "tessera-controller-nodes", "tessera-gang-annotations"} {
					want[p] = user
				}
				// Everyone, the controller included: no claim
				// tolerates the domain channels' taint.
				want["tessera-domain-channels"] = ""
			}
		}
		bindings := map[string][]admissionregistrationv1.ValidationAction{}
		for _, b := range find[*admissionregistrationv1.ValidatingAdmissionPolicyBinding](r) {
			bindings[b.Spec.PolicyName] = b.Spec.ValidationActions
		}
		var got []string
		for _, vap := range find[*admissionregistrationv1.ValidatingAdmissionPolicy](r) {
			got = append(got, vap.Name)
			user, ok := want[vap.Name]
			if !ok {
				continue
			}
			conds := vap.Spec.MatchConditions
			// The pod locks split the plugin's pod requests between
			// them by one more condition each (IMEX daemons or not),
			// complementary: every request meets exactly one
			// (TestHelmChartAppliesOnTheAPIServer holds both).
			wantConds, match := 1, fmt.Sprintf("request.userInfo.username == %q", user)
			if vap.Name == "tessera-gang-annotations" {
				// Everyone but the controller (and cluster
				// administrators, who can remove the policy).
				wantConds, match = 2, fmt.Sprintf("request.userInfo.username != %q", user)
				if len(conds) == 2 && conds[1].Expression != "!('system:masters' in request.userInfo.groups)" {
					t.Errorf("%s: policy %s's second match condition is %q, want it to leave out only system:masters", c.Name, vap.Name, conds[1].Expression)
				}
			}
			if user == "" {
				wantConds, match = 0, ""
			}
			if split, ok := podLockSplit[vap.Name]; ok {
				wantConds = 2
				if len(conds) == 2 && conds[1].Name != split {
					t.Errorf("%s: policy %s's second match condition is %s, want %s", c.Name, vap.Name, conds[1].Name, split)
				}
			}
			if len(conds) != wantConds || (wantConds > 0 && conds[0].Expression != match) {
				t.Errorf("%s: policy %s matches %+v, want %s", c.Name, vap.Name, conds, match)
			}
			if !slices.Equal(bindings[vap.Name], []admissionregistrationv1.ValidationAction{admissionregistrationv1.Deny}) {
				t.Errorf("%s: policy %s is bound with actions %v, want exactly Deny", c.Name, vap.Name, bindings[vap.Name])
			}
		}
		slices.Sort(got)
		if wantNames := slices.Sorted(maps.Keys(want)); !slices.Equal(got, wantNames) {
			t.Errorf("%s: policies rendered %v, want %v", c.Name, got, wantNames)
		}
	}
}

// podLockSplit names the condition by which each pod-lock policy takes its
// share of the plugin's pod requests.
var podLockSplit = map[string]string{
	"tessera-kubelet-plugin-mps-lock":  "not-an-imex-daemon",
	"tessera-kubelet-plugin-imex-lock": "is-an-imex-daemon",
}

func serviceAccountUser(namespace, name string) string {
	return "system:serviceaccount:" + namespace + ":" + name
}

// checkAccountBound checks that the service account exists and that the
// ClusterRoleBinding clusterBinding and the RoleBinding roleBinding (in its
// namespace) bind exactly it.
func checkAccountBound(t *testing.T, combo string, r rendered, namespace, account, clusterBinding, roleBinding string) {
	t.Helper()
	if !slices.ContainsFunc(find[*corev1.ServiceAccount](r), func(sa *corev1.ServiceAccount) bool {
		return sa.Namespace == namespace && sa.Name == account
	}) {
		t.Errorf("%s: service account %s/%s is not rendered", combo, namespace, account)
	}
	want := []rbacv1.Subject{{Kind: "ServiceAccount", Name: account, Namespace: namespace}}
	for _, b := range find[*rbacv1.ClusterRoleBinding](r) {
		if b.Name == clusterBinding && !slices.Equal(b.Subjects, want) {
			t.Errorf("%s: ClusterRoleBinding %s binds %+v, want %+v", combo, b.Name, b.Subjects, want)
		}
	}
	for _, b := range find[*rbacv1.RoleBinding](r) {
		if b.Name == roleBinding && (b.Namespace != namespace || !slices.Equal(b.Subjects, want)) {
			t.Errorf("%s: RoleBinding %s/%s binds %+v, want %+v in %s", combo, b.Namespace, b.Name, b.Subjects, want, namespace)
		}
	}
}

// one returns the only element of objs.
func one[T any](t *testing.T, combo string, objs []T) T {
	t.Helper()
	if len(objs) != 1 {
		var zero T
		t.Fatalf("%s: %d objects of type %T rendered, want 1", combo, len(objs), zero)
	}
	return objs[0]
}

// runFlags parses and validates a container's arguments exactly as the
// binary does (component.Run, with o its options) and checks that every
// environment variable the container sets is one a flag falls back to,
// except those the values add as they are (extra, e.g. kubeletPlugin.extraEnv).
func runFlags(t *testing.T, combo string, ctr corev1.Container, o component.Options, extra ...string) {
	t.Helper()
	fs := pflag.NewFlagSet(ctr.Command[0], pflag.ContinueOnError)
	o.AddFlags(fs)
	for _, e := range ctr.Env {
		if slices.Contains(extra, e.Name) {
			continue
		}
		used := false
		fs.VisitAll(func(f *pflag.Flag) { used = used || strings.Contains(f.Usage, "Environment: "+e.Name+".") })
		if !used {
			t.Errorf("%s: %s: environment %s is read by no flag", combo, ctr.Command[0], e.Name)
		}
	}
	if err := component.Run(ctr.Command[0], ctr.Args, o, func(context.Context) error { return nil }); err != nil {
		t.Errorf("%s: %s refuses its arguments %q: %v", combo, ctr.Command[0], ctr.Args, err)
	}
}

// extraEnvNames are the names of the environment variables a component's
// values (e.g. Values["kubeletPlugin"]) add through extraEnv.
func extraEnvNames(component any) []string {
	values, _ := component.(map[string]any)
	env, _ := values["extraEnv"].([]any)
	var names []string
	for _, e := range env {
		if m, ok := e.(map[string]any); ok {
			names = append(names, fmt.Sprint(m["name"]))
		}
	}
	return names
}

// fieldRefs maps a container's environment variables to their downward-API
// field paths.
func fieldRefs(ctr corev1.Container) map[string]string {
	out := map[string]string{}
	for _, e := range ctr.Env {
		if e.ValueFrom != nil && e.ValueFrom.FieldRef != nil {
			out[e.Name] = e.ValueFrom.FieldRef.FieldPath
		}
	}
	return out
}

// TestDaemonSetRunsThePlugin: in every combination the DaemonSet's
// arguments parse and validate with the plugin's own flags; node name, pod
// UID and namespace come from the downward API; every directory the plugin
// writes or the kubelet and container runtime read is a host path mounted at
// the same path; updates surge; the liveness probe reaches --health-address
// and /metrics stays on the pod's loopback.
func TestDaemonSetRunsThePlugin(t *testing.T) {
	for _, c := range Combinations() {
		ds := one(t, c.Name, find[*appsv1.DaemonSet](renderT(t, c)))
		pod := ds.Spec.Template.Spec
		ctr := one(t, c.Name, pod.Containers)
		var o plugin.Options
		runFlags(t, c.Name, ctr, &o, extraEnvNames(c.Values["kubeletPlugin"])...)
		wantRefs := map[string]string{"NODE_NAME": "spec.nodeName", "POD_NAMESPACE": "metadata.namespace", "POD_UID": "metadata.uid"}
		if got := fieldRefs(ctr); fmt.Sprint(got) != fmt.Sprint(wantRefs) {
			t.Errorf("%s: downward-API environment %v, want %v", c.Name, got, wantRefs)
		}
		hostDirs := []string{o.PluginDataDir, o.RegistrarDir, o.CDIRoot, filepath.Dir(o.CDIHook)}
		if o.Node.FakeNode == "" {
			// The host's driver root (/ included) is where the plugin
			// reads it, and the specs name the host's paths.
			root := "/"
			if v, ok := componentValue(c.Values, "kubeletPlugin", "driverRoot").(string); ok {
				root = v
			}
			if o.Node.HostDriverRoot != root || !mountedReadOnly(pod, ctr, root, o.Node.DriverRoot) {
				t.Errorf("%s: the host's driver root %q is not mounted read-only at --driver-root %q with --host-driver-root %q naming it", c.Name, root, o.Node.DriverRoot, o.Node.HostDriverRoot)
			}
			// Its dev/ is writable: on-demand device nodes are made there.
			if !slices.ContainsFunc(ctr.VolumeMounts, func(m corev1.VolumeMount) bool {
				return m.MountPath == filepath.Join(o.Node.DriverRoot, "dev") && !m.ReadOnly &&
					slices.ContainsFunc(pod.Volumes, func(v corev1.Volume) bool {
						return v.Name == m.Name && v.HostPath != nil && v.HostPath.Path == filepath.Join(root, "dev")
					})
			}) {
				t.Errorf("%s: the host's %s is not mounted writable at %s", c.Name, filepath.Join(root, "dev"), filepath.Join(o.Node.DriverRoot, "dev"))
			}
		}
		if install := one(t, c.Name, pod.InitContainers); !slices.Equal(install.Command, []string{"tessera-cdi-hook", "install", o.CDIHook}) || !slices.ContainsFunc(install.VolumeMounts, func(m corev1.VolumeMount) bool { return m.MountPath == o.PluginDataDir }) {
			t.Errorf("%s: init container %s %v does not install the hook at --cdi-hook %s", c.Name, install.Name, install.Command, o.CDIHook)
		}
		if o.Node.FakeNode != "" {
			hostDirs = append(hostDirs, o.Node.FakeRoot)
		}
		for _, dir := range hostDirs {
			if !mountedFromHost(pod, ctr, dir) {
				t.Errorf("%s: %s is not a host path mounted at the same path", c.Name, dir)
			}
		}
		// The update strategy: TestPluginUpgradesCanProceed.
		checkProbe(t, c.Name, ctr, ctr.LivenessProbe, o.HealthAddress)
		// Ready once the kubelet registered it: a rolling update keeps
		// the old plugin pod until then.
		checkProbeAt(t, c.Name, ctr, ctr.ReadinessProbe, o.HealthAddress, "/readyz")
		checkMetrics(t, c.Name, ctr, o.MetricsAddress, componentValue(c.Values, "kubeletPlugin", "metricsBindAddress"))
		if ctr.SecurityContext == nil || ctr.SecurityContext.Privileged == nil || !*ctr.SecurityContext.Privileged {
			t.Errorf("%s: the plugin is not privileged (NVML, MIG)", c.Name)
		}
		if pod.PriorityClassName != "system-node-critical" || len(pod.NodeSelector) == 0 {
			t.Errorf("%s: priority class %q, node selector %v: want system-node-critical on GPU nodes", c.Name, pod.PriorityClassName, pod.NodeSelector)
		}
	}
}

// mountedReadOnly reports whether the host path is mounted read-only at
// mountPath.
func mountedReadOnly(pod corev1.PodSpec, ctr corev1.Container, hostPath, mountPath string) bool {
	for _, m := range ctr.VolumeMounts {
		for _, v := range pod.Volumes {
			if v.Name == m.Name && v.HostPath != nil && v.HostPath.Path == hostPath && m.MountPath == mountPath && m.ReadOnly {
				return true
			}
		}
	}
	return false
}

// mountedFromHost reports whether dir lies under a mount of a hostPath
// volume whose host path is its mount path.
func mountedFromHost(pod corev1.PodSpec, ctr corev1.Container, dir string) bool {
	for _, m := range ctr.VolumeMounts {
		for _, v := range pod.Volumes {
			if v.Name != m.Name || v.HostPath == nil || v.HostPath.Path != m.MountPath {
				continue
			}
			if rel, err := filepath.Rel(m.MountPath, dir); err == nil && !strings.HasPrefix(rel, "..") {
				return true
			}
		}
	}
	return false
}

// checkProbe checks that probe asks /healthz on the port of address
// (host:port), and that address listens where the kubelet's probe reaches
// it: on the pod's IP, not its loopback.
func checkProbe(t *testing.T, combo string, ctr corev1.Container, probe *corev1.Probe, address string) {
	t.Helper()
	checkProbeAt(t, combo, ctr, probe, address, "/healthz")
}

// checkProbeAt is checkProbe for the probe of path.
func checkProbeAt(t *testing.T, combo string, ctr corev1.Container, probe *corev1.Probe, address, path string) {
	t.Helper()
	if probe == nil || probe.HTTPGet == nil || probe.HTTPGet.Path != path {
		t.Errorf("%s: %s: probe %+v, want GET %s", combo, ctr.Name, probe, path)
		return
	}
	if host, _, err := net.SplitHostPort(address); err != nil || isLoopback(host) {
		t.Errorf("%s: %s: /healthz is served at %q, where the kubelet's probe cannot reach it", combo, ctr.Name, address)
	}
	port := probe.HTTPGet.Port.IntValue()
	for _, p := range ctr.Ports {
		if p.Name == probe.HTTPGet.Port.String() {
			port = int(p.ContainerPort)
		}
	}
	if !strings.HasSuffix(address, ":"+strconv.Itoa(port)) {
		t.Errorf("%s: %s: probe on port %d, but /healthz is served at %q", combo, ctr.Name, port, address)
	}
}

// checkMetrics checks that /metrics listens on the pod's loopback, or on
// bindAddress where the values set metricsBindAddress, and that the
// container declares a metrics port exactly when /metrics is reachable from
// outside the pod.
func checkMetrics(t *testing.T, combo string, ctr corev1.Container, address string, bindAddress any) {
	t.Helper()
	want := "127.0.0.1"
	if bindAddress != nil {
		want = fmt.Sprint(bindAddress)
	}
	host, port, err := net.SplitHostPort(address)
	if err != nil || host != want {
		t.Errorf("%s: %s: /metrics is served at %q, want host %s", combo, ctr.Name, address, want)
		return
	}
	declared := slices.ContainsFunc(ctr.Ports, func(p corev1.ContainerPort) bool {
		return p.Name == "metrics" && strconv.Itoa(int(p.ContainerPort)) == port
	})
	if declared == isLoopback(host) {
		t.Errorf("%s: %s: /metrics at %q, container ports %+v: want a port named metrics exactly when it is reachable from outside the pod", combo, ctr.Name, address, ctr.Ports)
	}
}

func isLoopback(host string) bool {
	ip := net.ParseIP(host)
	return host == "localhost" || (ip != nil && ip.IsLoopback())
}

// componentValue is values[component][key], or nil.
func componentValue(values map[string]any, component, key string) any {
	c, _ := values[component].(map[string]any)
	return c[key]
}

// TestControllerRunsWithLeaderElection: the controller's arguments parse
// and validate with its own flags, leader election is on, the Lease is in
// the release namespace, the liveness probe reaches --health-address and
// /metrics stays on the pod's loopback unless the values open it.
func TestControllerRunsWithLeaderElection(t *testing.T) {
	for _, c := range Combinations() {
		for _, d := range find[*appsv1.Deployment](renderT(t, c)) {
			if d.Name != "tessera-controller" {
				continue
			}
			ctr := one(t, c.Name, d.Spec.Template.Spec.Containers)
			var o controller.Options
			runFlags(t, c.Name, ctr, &o)
			if !o.LeaderElect {
				t.Errorf("%s: leader election is off", c.Name)
			}
			if got := fieldRefs(ctr)["POD_NAMESPACE"]; got != "metadata.namespace" {
				t.Errorf("%s: POD_NAMESPACE from %q, want metadata.namespace (the Lease's namespace, where its Role is)", c.Name, got)
			}
			checkProbe(t, c.Name, ctr, ctr.LivenessProbe, o.HealthAddress)
			checkMetrics(t, c.Name, ctr, o.MetricsAddress, componentValue(c.Values, "controller", "metricsBindAddress"))
		}
	}
}

// TestWebhookIsReachable: where the webhook is on, its arguments parse and
// validate with its own flags; it serves the TLS Secret's files; the
// configuration calls its Service, whose port reaches the HTTPS port; and
// the CA comes from the Certificate cert-manager issues for the Service's
// DNS name, or from the caBundle value.
func TestWebhookIsReachable(t *testing.T) {
	for _, c := range Combinations() {
		r := renderT(t, c)
		vwcs := find[*admissionregistrationv1.ValidatingWebhookConfiguration](r)
		if webhookValues(c.Values)["enabled"] != true {
			if len(vwcs) != 0 {
				t.Errorf("%s: webhook configuration rendered with the webhook off", c.Name)
			}
			continue
		}
		vwc := one(t, c.Name, vwcs)
		d := one(t, c.Name, slices.DeleteFunc(find[*appsv1.Deployment](r), func(d *appsv1.Deployment) bool { return d.Name != "tessera-webhook" }))
		svc := one(t, c.Name, find[*corev1.Service](r))
		pod := d.Spec.Template.Spec
		ctr := one(t, c.Name, pod.Containers)
		var o webhook.Options
		runFlags(t, c.Name, ctr, &o)
		secret := ""
		for _, v := range pod.Volumes {
			for _, m := range ctr.VolumeMounts {
				if v.Name == m.Name && v.Secret != nil && filepath.Dir(o.TLSCertFile) == m.MountPath && filepath.Dir(o.TLSPrivateKeyFile) == m.MountPath {
					secret = v.Secret.SecretName
				}
			}
		}
		if secret == "" || filepath.Base(o.TLSCertFile) != "tls.crt" || filepath.Base(o.TLSPrivateKeyFile) != "tls.key" {
			t.Errorf("%s: the webhook does not serve tls.crt and tls.key of a mounted Secret (%s, %s)", c.Name, o.TLSCertFile, o.TLSPrivateKeyFile)
		}
		if len(svc.Spec.Ports) != 1 || svc.Spec.Ports[0].TargetPort.String() != "https" ||
			!slices.ContainsFunc(ctr.Ports, func(p corev1.ContainerPort) bool { return p.Name == "https" && int(p.ContainerPort) == o.Port }) {
			t.Errorf("%s: Service ports %+v do not reach the webhook's --port %d", c.Name, svc.Spec.Ports, o.Port)
		}
		for _, w := range vwc.Webhooks {
			s := w.ClientConfig.Service
			if s == nil || s.Namespace != svc.Namespace || s.Name != svc.Name || s.Port == nil || *s.Port != svc.Spec.Ports[0].Port || s.Path == nil || *s.Path != webhook.Path {
				t.Errorf("%s: webhook %s calls %+v, not the Service %s/%s at %s", c.Name, w.Name, s, svc.Namespace, svc.Name, webhook.Path)
			}
		}
		checkProbe(t, c.Name, ctr, ctr.LivenessProbe, o.HealthAddress)
		checkMetrics(t, c.Name, ctr, o.MetricsAddress, componentValue(c.Values, "webhook", "metricsBindAddress"))
		checkWebhookCA(t, c, r, vwc, svc, secret)
	}
}

// checkWebhookCA checks where the webhook configuration's CA comes from.
func checkWebhookCA(t *testing.T, c Combination, r rendered, vwc *admissionregistrationv1.ValidatingWebhookConfiguration, svc *corev1.Service, secret string) {
	t.Helper()
	var cert *unstructured.Unstructured
	for _, u := range r.certManager {
		if u.GetKind() == "Certificate" {
			cert = u
		}
	}
	if cert == nil {
		for _, w := range vwc.Webhooks {
			if len(w.ClientConfig.CABundle) == 0 {
				t.Errorf("%s: webhook %s has no caBundle and no cert-manager Certificate", c.Name, w.Name)
			}
		}
		return
	}
	if got, want := vwc.Annotations["cert-manager.io/inject-ca-from"], cert.GetNamespace()+"/"+cert.GetName(); got != want {
		t.Errorf("%s: inject-ca-from %q, want the Certificate %q", c.Name, got, want)
	}
	secretName, _, _ := unstructured.NestedString(cert.Object, "spec", "secretName")
	dnsNames, _, _ := unstructured.NestedStringSlice(cert.Object, "spec", "dnsNames")
	if secretName != secret || !slices.Contains(dnsNames, svc.Name+"."+svc.Namespace+".svc") {
		t.Errorf("%s: Certificate writes %q for %v; want the mounted Secret %q for %s.%s.svc", c.Name, secretName, dnsNames, secret, svc.Name, svc.Namespace)
	}
}

// TestPluginUpgradesCanProceed: the DaemonSet's rolling update must be able
// to finish on every node. In the pod network it surges (the new plugin pod
// starts beside the old one, which leaves once the new one is ready: no
// kubelet call goes unserved). In the host network a pod's container ports
// are the node's ports, so a surge pod would wait forever for its old pod's
// ports (the scheduler refuses it the node): there the old pod must go
// first.
func TestPluginUpgradesCanProceed(t *testing.T) {
	for _, c := range Combinations() {
		ds := one(t, c.Name, find[*appsv1.DaemonSet](renderT(t, c)))
		pod := ds.Spec.Template.Spec
		u := ds.Spec.UpdateStrategy
		if u.Type != appsv1.RollingUpdateDaemonSetStrategyType || u.RollingUpdate == nil || u.RollingUpdate.MaxSurge == nil || u.RollingUpdate.MaxUnavailable == nil {
			t.Errorf("%s: update strategy %+v, want a rolling update with maxSurge and maxUnavailable", c.Name, u)
			continue
		}
		surge, unavailable := u.RollingUpdate.MaxSurge.IntValue(), u.RollingUpdate.MaxUnavailable.IntValue()
		ports := 0
		for _, ctr := range pod.Containers {
			ports += len(ctr.Ports)
		}
		switch {
		case pod.HostNetwork && ports > 0 && (surge != 0 || unavailable != 1):
			t.Errorf("%s: in the host network with %d container ports, maxSurge %d and maxUnavailable %d: a surge pod can never take the node's ports; want 0 and 1", c.Name, ports, surge, unavailable)
		case !pod.HostNetwork && (surge != 1 || unavailable != 0):
			t.Errorf("%s: in the pod network, maxSurge %d and maxUnavailable %d, want 1 and 0: the new plugin starts before the old one leaves", c.Name, surge, unavailable)
		}
	}
}
