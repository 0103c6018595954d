package e2e

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"

	"github.com/tessera-dev/tessera/deployments/helm"
	"github.com/tessera-dev/tessera/test/cluster"
)

// TestHelmChartAppliesOnTheAPIServer renders the Helm chart for every
// values combination (deployments/helm.Combinations) and creates every
// object on a real Kubernetes 1.37 API server the way Helm 4 installs a
// release: server-side apply with strict field validation, kind by kind in
// Helm's install order. So every manifest is one the API server accepts,
// not merely one that decodes. cert-manager's objects are the only ones not
// applied (the local cluster has no cert-manager): exactly an Issuer and a
// Certificate, and only where cert-manager was asked for. After each
// combination the kubelet plugin's service account, with a token bound to a
// node, is refused writing another node's ResourceSlice: the chart's
// node-lock policy applies to the DaemonSet's account in that namespace
// (checkNodeLock). With that token it can create the MPS daemon pod
// driver/mps builds from the DaemonSet's flags and nothing else: no pod on
// another node, as another service account or with a token, with another
// image or command, more host paths or host access (checkMPSLock). Where the
// controller is rendered, its service account can release gang members and
// write its domain slices and gang claims, but not change a pod's image nor
// write another driver's or a node's slice (checkControllerLock).
// Each combination's cluster-scoped objects are deleted before the next, so
// each is created afresh.
func TestHelmChartAppliesOnTheAPIServer(t *testing.T) {
	t.Parallel()
	c := cluster.StartT(t, cluster.Options{}) // no nodes: nothing is scheduled
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
	defer cancel()
	a := newApplier(t, c.RESTConfig())
	for _, n := range []string{"node-a", "node-b"} {
		if _, err := c.Client().CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	for _, combo := range helm.Combinations() {
		start := time.Now()
		manifests, err := helm.Render(ctx, combo.Values, combo.Release)
		if err != nil {
			t.Fatalf("%s: %v", combo.Name, err)
		}
		rendered := time.Since(start)
		createsNamespace := slices.ContainsFunc(manifests, func(m helm.Manifest) bool { return m.Kind == "Namespace" })
		if !createsNamespace { // helm install --create-namespace
			if err := c.CreateNamespace(ctx, combo.Release.Namespace); err != nil {
				t.Fatal(err)
			}
		}
		start = time.Now()
		created, skipped := a.install(ctx, t, combo.Name, manifests)
		applied := time.Since(start)
		wantSkipped := []string(nil)
		if w, _ := combo.Values["webhook"].(map[string]any); w != nil && w["certManager"] != nil {
			wantSkipped = []string{"Certificate", "Issuer"}
		}
		if !slices.Equal(skipped, wantSkipped) {
			t.Errorf("%s: objects not applied: %v, want exactly cert-manager's %v", combo.Name, skipped, wantSkipped)
		}
		t.Logf("%s: rendered in %v; %d objects created on the API server in %v", combo.Name, rendered.Round(time.Millisecond), len(created), applied.Round(time.Millisecond))

		checkNodeLock(ctx, t, c, combo.Name, combo.Release.Namespace)
		checkMPSLock(ctx, t, c, combo.Name, combo.Release.Namespace, manifests)
		checkIMEXLock(ctx, t, c, combo.Name, combo.Release.Namespace, manifests)
		if rendersController(t, manifests) {
			checkControllerLock(ctx, t, c, combo.Name, combo.Release.Namespace)
			checkGangAnnotations(ctx, t, c, combo.Name, combo.Release.Namespace)
			checkDomainChannels(ctx, t, c, combo.Name, combo.Release.Namespace)
		}
		a.deleteClusterScoped(ctx, t, combo.Name, created)
	}
}

// applier creates rendered objects through the dynamic client.
type applier struct {
	dyn    dynamic.Interface
	mapper *restmapper.DeferredDiscoveryRESTMapper
	cached discovery.CachedDiscoveryInterface
}

func newApplier(t *testing.T, cfg *rest.Config) *applier {
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	disco, err := discovery.NewDiscoveryClientForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	cached := memory.NewMemCacheClient(disco)
	return &applier{dyn: dyn, mapper: restmapper.NewDeferredDiscoveryRESTMapper(cached), cached: cached}
}

// resource returns the client of an object's resource, refreshing
// discovery once for a kind a CRD just added.
func (a *applier) resource(u *unstructured.Unstructured) (dynamic.ResourceInterface, bool, error) {
	gvk := u.GroupVersionKind()
	mapping, err := a.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	if meta.IsNoMatchError(err) {
		a.cached.Invalidate()
		a.mapper.Reset()
		mapping, err = a.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	}
	if err != nil {
		return nil, false, err
	}
	if mapping.Scope.Name() == meta.RESTScopeNameNamespace {
		return a.dyn.Resource(mapping.Resource).Namespace(u.GetNamespace()), true, nil
	}
	return a.dyn.Resource(mapping.Resource), false, nil
}

// install applies manifests in order, as Helm 4 does (server-side apply,
// strict field validation), after checking that none exists yet. It returns
// the objects created and the kinds of cert-manager objects left out.
func (a *applier) install(ctx context.Context, t *testing.T, combo string, manifests []helm.Manifest) (created []*unstructured.Unstructured, skipped []string) {
	t.Helper()
	for _, m := range manifests {
		u := &unstructured.Unstructured{}
		if err := yaml.Unmarshal([]byte(m.YAML), &u.Object); err != nil {
			t.Fatalf("%s: %s: %v", combo, m.Source, err)
		}
		if u.GroupVersionKind().Group == "cert-manager.io" {
			skipped = append(skipped, u.GetKind())
			continue
		}
		id := fmt.Sprintf("%s %s/%s (%s)", u.GetKind(), u.GetNamespace(), u.GetName(), m.Source)
		res, _, err := a.resource(u)
		if err != nil {
			t.Fatalf("%s: %s: %v", combo, id, err)
		}
		if _, err := res.Get(ctx, u.GetName(), metav1.GetOptions{}); !apierrors.IsNotFound(err) && !isCRD(u) {
			t.Fatalf("%s: %s exists before the install (%v): it would be updated, not created", combo, id, err)
		}
		data, err := u.MarshalJSON()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := res.Patch(ctx, u.GetName(), types.ApplyPatchType, data, metav1.PatchOptions{
			FieldManager: "helm", FieldValidation: metav1.FieldValidationStrict}); err != nil {
			t.Errorf("%s: the API server refuses %s: %v", combo, id, err)
			continue
		}
		created = append(created, u)
	}
	slices.Sort(skipped)
	return created, skipped
}

// deleteClusterScoped deletes the cluster-scoped objects a combination
// created and waits until they are gone; namespaced ones go with their
// namespace, which the next combination does not use.
func (a *applier) deleteClusterScoped(ctx context.Context, t *testing.T, combo string, created []*unstructured.Unstructured) {
	t.Helper()
	for _, u := range slices.Backward(created) {
		res, namespaced, err := a.resource(u)
		if err != nil {
			t.Fatal(err)
		}
		if namespaced || isCRD(u) {
			continue
		}
		if err := res.Delete(ctx, u.GetName(), metav1.DeleteOptions{}); err != nil {
			t.Fatalf("%s: delete %s %s: %v", combo, u.GetKind(), u.GetName(), err)
		}
		err = wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
			_, err := res.Get(ctx, u.GetName(), metav1.GetOptions{})
			return apierrors.IsNotFound(err), nil
		})
		if err != nil {
			t.Fatalf("%s: %s %s not gone a minute after its deletion: %v", combo, u.GetKind(), u.GetName(), err)
		}
	}
}

// isCRD says whether the object is a CustomResourceDefinition. Helm installs
// a chart's CRDs (its crds/ folder) only where they are absent and never
// deletes them, so one combination's stays for the next, as it would on a
// cluster. Deleting it between combinations, as this test once did, made the
// API server's CRD finalizer retry "storage is (re)initializing" with a
// growing back-off for over two minutes (seen in CI).
func isCRD(u *unstructured.Unstructured) bool {
	return u.GetKind() == "CustomResourceDefinition"
}

// checkNodeLock writes ResourceSlices as the chart's kubelet-plugin service
// account in namespace, with a token bound to node-a: node-b's slice is
// refused by the chart's node-lock policy (once the API server has loaded
// it), node-a's is accepted.
func checkNodeLock(ctx context.Context, t *testing.T, c *cluster.Cluster, combo, namespace string) {
	t.Helper()
	admin := c.Client()
	plugin := pluginTokenClient(ctx, t, c, namespace, "node-a")
	slice := func(node string) *resourceapi.ResourceSlice {
		return &resourceapi.ResourceSlice{
			ObjectMeta: metav1.ObjectMeta{Name: combo + "-" + node},
			Spec: resourceapi.ResourceSliceSpec{Driver: driverName, NodeName: ptr.To(node),
				Pool: resourceapi.ResourcePool{Name: node, ResourceSliceCount: 1}, Devices: []resourceapi.Device{{Name: "gpu-0"}}},
		}
	}
	foreign := slice("node-b")
	start := time.Now()
	var refusal error
	err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		if _, refusal = plugin.ResourceV1().ResourceSlices().Create(ctx, foreign, metav1.CreateOptions{}); refusal == nil {
			return false, admin.ResourceV1().ResourceSlices().Delete(ctx, foreign.Name, metav1.DeleteOptions{})
		}
		return true, nil
	})
	if err != nil || !strings.Contains(refusal.Error(), "may only write ResourceSlices of its own node") {
		t.Errorf("%s: the plugin's account in %s, bound to node-a, wrote node-b's slice or was refused for another reason: %v, %v", combo, namespace, err, refusal)
		return
	}
	t.Logf("%s: node-lock policy refused the plugin's foreign write %v after the install", combo, time.Since(start).Round(time.Millisecond))
	inPoolB := slice("node-a")
	inPoolB.Name += "-in-pool-b"
	inPoolB.Spec.Pool.Name = "node-b"
	if _, err := plugin.ResourceV1().ResourceSlices().Create(ctx, inPoolB, metav1.CreateOptions{}); err == nil || !strings.Contains(err.Error(), "in its own pool") {
		t.Errorf("%s: the plugin's account in %s, bound to node-a, wrote a slice of node-a in node-b's pool: %v", combo, namespace, err)
	}
	own := slice("node-a")
	if _, err := plugin.ResourceV1().ResourceSlices().Create(ctx, own, metav1.CreateOptions{}); err != nil {
		t.Errorf("%s: the plugin's account in %s cannot write its own node's slice: %v", combo, namespace, err)
		return
	}
	if err := plugin.ResourceV1().ResourceSlices().Delete(ctx, own.Name, metav1.DeleteOptions{}); err != nil {
		t.Errorf("%s: the plugin's account cannot delete its own node's slice: %v", combo, err)
	}
}
