package e2e

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/ptr"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/controller"
	"github.com/tessera-dev/tessera/controller/gang"
	"github.com/tessera-dev/tessera/deployments/crds"
	"github.com/tessera-dev/tessera/deployments/rbac"
	"github.com/tessera-dev/tessera/test/cluster"
)

// This file runs tessera-controller in-process, as its own service account
// (deployments/rbac/controller.yaml), against a local cluster, and holds the
// gang tests' helpers.

const domainClass = "domain.gpu.tessera.dev"

// unschedulableGrace is the controller's --unschedulable-grace in the tests:
// long enough for the scheduler's retries of a member whose claims it has
// not seen allocated yet; short for the tests of a member that cannot be
// scheduled or is refused at prepare.
const unschedulableGrace = 15 * time.Second

// installController applies the Gang CRD and the controller's RBAC and
// returns a kubeconfig of the controller's service account.
func installController(ctx context.Context, c *cluster.Cluster) (string, error) {
	if err := c.Apply(ctx, crds.Gang); err != nil {
		return "", fmt.Errorf("install the Gang CRD: %w", err)
	}
	if err := c.Apply(ctx, rbac.KubeletPlugin); err != nil { // the namespace
		return "", err
	}
	if err := c.Apply(ctx, rbac.Controller); err != nil {
		return "", fmt.Errorf("install controller RBAC: %w", err)
	}
	// The CRD is served once established.
	dyn, err := dynamic.NewForConfig(c.RESTConfig())
	if err != nil {
		return "", err
	}
	err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		_, err := dyn.Resource(gangv1.GroupVersionResource).Namespace("default").List(ctx, metav1.ListOptions{})
		return err == nil, nil
	})
	if err != nil {
		return "", fmt.Errorf("the Gang CRD is not served: %w", err)
	}
	return c.ServiceAccountKubeconfig(ctx, rbac.Namespace, rbac.ControllerAccount)
}

// runningController is an in-process tessera-controller.
type runningController struct {
	cancel context.CancelFunc
	done   chan error
	// ended is closed once Run returned (a test may have taken its
	// error from done).
	ended chan struct{}
	// metrics is where it serves /metrics.
	metrics string
}

// installAndStartController installs tessera-controller's CRD and RBAC on
// c and starts it as its service account (startController), failing t if
// it cannot.
func installAndStartController(ctx context.Context, t testing.TB, c *cluster.Cluster, topologyKey string) *runningController {
	t.Helper()
	kubeconfig, err := installController(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	return startController(t, kubeconfig, topologyKey, nil)
}

// startController runs the controller as its service account until stop (or
// t's end). interrupt, if set, is the gang.Options.Interrupt test hook.
func startController(t testing.TB, kubeconfig, topologyKey string, interrupt func(string) bool) *runningController {
	t.Helper()
	return startControllerWith(t, kubeconfig, func(o *controller.Options) {
		o.TopologyKey, o.Interrupt = topologyKey, interrupt
	})
}

// startControllerWith is startController with edit applied to its options.
func startControllerWith(t testing.TB, kubeconfig string, edit func(*controller.Options)) *runningController {
	t.Helper()
	_, ctx := ktesting.NewTestContext(t)
	ctx, cancel := context.WithCancel(ctx)
	o := controller.Options{
		Kubeconfig: kubeconfig, KubeAPIQPS: 500, KubeAPIBurst: 1000,
		Channels:    8,
		LeaderElect: true, LeaseNamespace: rbac.Namespace, LeaseName: "tessera-controller",
		LeaseDuration: 6 * time.Second, RenewDeadline: 4 * time.Second, RetryPeriod: time.Second,
		UnschedulableGrace: unschedulableGrace,
		NodeLabels:         true, // on by default, as the flag is
	}
	edit(&o)
	// A free port for /metrics, as the chart gives it one.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	o.MetricsAddress = ln.Addr().String()
	_ = ln.Close()
	if err := o.Validate(); err != nil {
		t.Fatal(err)
	}
	rc := &runningController{cancel: cancel, done: make(chan error, 1), ended: make(chan struct{}), metrics: o.MetricsAddress}
	go func() {
		rc.done <- controller.Run(ctx, o)
		close(rc.ended)
	}()
	t.Cleanup(func() { rc.stop() })
	return rc
}

// counter scrapes the controller's /metrics and returns the value of one
// series, e.g. `tessera_gang_placement_attempts_total{result="placed"}`
// (0 when absent).
func (rc *runningController) counter(t testing.TB, series string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + rc.metrics + "/metrics")
	if err != nil {
		t.Fatalf("scrape the controller's metrics: %v", err)
	}
	defer func() { _ = resp.Body.Close() }()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(body), "\n") {
		if v, ok := strings.CutPrefix(line, series+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatalf("metric %s: %v", line, err)
			}
			return f
		}
	}
	return 0
}

// stopped is what a stop reports of Run's error: a controller stopped
// before it finished starting (its informers had not synced yet) returns
// context.Canceled, which is a stop, not a failure.
func stopped(err error) error {
	if errors.Is(err, context.Canceled) {
		return nil
	}
	return err
}

// stop cancels the controller and waits for it; it returns what Run did.
func (rc *runningController) stop() error {
	rc.cancel()
	select {
	case err := <-rc.done:
		rc.done <- err
		return stopped(err)
	case <-rc.ended:
		select {
		case err := <-rc.done: // it returned just now
			rc.done <- err
			return stopped(err)
		default:
			// Run returned and a test took its error (a controller
			// killed at a step): nothing left to stop.
			return nil
		}
	case <-time.After(30 * time.Second):
		return errors.New("controller did not stop within 30s")
	}
}

// gangs reads and writes gangs as an admin.
type gangs struct {
	dyn dynamic.Interface
}

func newGangs(t testing.TB, c *cluster.Cluster) gangs {
	dyn, err := dynamic.NewForConfig(c.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}
	return gangs{dyn: dyn}
}

func (gs gangs) create(ctx context.Context, t testing.TB, g *gangv1.Gang) {
	t.Helper()
	g.APIVersion, g.Kind = gangv1.Group+"/"+gangv1.Version, gangv1.Kind
	obj, err := runtime.DefaultUnstructuredConverter.ToUnstructured(g)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := gs.dyn.Resource(gangv1.GroupVersionResource).Namespace(g.Namespace).Create(ctx, &unstructured.Unstructured{Object: obj}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create gang %s/%s: %v", g.Namespace, g.Name, err)
	}
}

func (gs gangs) get(ctx context.Context, t testing.TB, ns, name string) *gangv1.Gang {
	t.Helper()
	u, err := gs.dyn.Resource(gangv1.GroupVersionResource).Namespace(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("get gang %s/%s: %v", ns, name, err)
	}
	g, err := gang.FromUnstructured(u)
	if err != nil {
		t.Fatal(err)
	}
	return g
}

func (gs gangs) delete(ctx context.Context, t testing.TB, ns, name string) {
	t.Helper()
	err := gs.dyn.Resource(gangv1.GroupVersionResource).Namespace(ns).Delete(ctx, name, metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		t.Fatalf("delete gang %s/%s: %v", ns, name, err)
	}
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		_, err := gs.dyn.Resource(gangv1.GroupVersionResource).Namespace(ns).Get(ctx, name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	})
	if err != nil {
		t.Fatalf("gang %s/%s not gone (finalizer %s kept?): %v", ns, name, gangv1.Finalizer, err)
	}
}

// waitCondition waits until the gang's condition has the status; it fails
// the test with the gang's conditions otherwise.
func (gs gangs) waitCondition(ctx context.Context, t testing.TB, ns, name, cond string, status metav1.ConditionStatus, timeout time.Duration) *gangv1.Gang {
	t.Helper()
	var g *gangv1.Gang
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		g = gs.get(ctx, t, ns, name)
		return meta.IsStatusConditionPresentAndEqual(g.Status.Conditions, cond, status), nil
	})
	if err != nil {
		t.Fatalf("gang %s/%s: condition %s not %s within %v; conditions:\n%s", ns, name, cond, status, timeout, describeConditions(g))
	}
	return g
}

func describeConditions(g *gangv1.Gang) string {
	if g == nil {
		return "  (no gang)"
	}
	var b strings.Builder
	for _, c := range g.Status.Conditions {
		fmt.Fprintf(&b, "  %s=%s %s: %s\n", c.Type, c.Status, c.Reason, c.Message)
	}
	return b.String()
}

// domainClaim is a claim for one channel of a gang domain, to be shared by
// every member.
func domainClaim(ns, name string, selectors ...string) *resourceapi.ResourceClaim {
	req := resourceapi.ExactDeviceRequest{DeviceClassName: domainClass}
	for _, s := range selectors {
		req.Selectors = append(req.Selectors, resourceapi.DeviceSelector{CEL: &resourceapi.CELDeviceSelector{Expression: s}})
	}
	return &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec:       resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{Name: "domain", Exactly: &req}}}},
	}
}

// memberPod is a gated gang member with a GPU claim from template and,
// if domain is set, the shared domain claim.
func memberPod(ns, name, gangLabel, template, domain string) *corev1.Pod {
	claims := []corev1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: ptr.To(template)}}
	if domain != "" {
		claims = append(claims, corev1.PodResourceClaim{Name: "domain", ResourceClaimName: ptr.To(domain)})
	}
	pod := newGPUPod(ns, name, claims...)
	pod.Labels = map[string]string{"gang": gangLabel}
	pod.Spec.SchedulingGates = []corev1.PodSchedulingGate{{Name: gangv1.SchedulingGate}}
	return pod
}

// runJobGang runs a gang of an indexed Job of size members, each with a
// claim from template and the shared domain claim, deleted at t's end; it
// returns the members and the gang once every member runs.
func (c *tesseraCluster) runJobGang(ctx context.Context, t *testing.T, gs gangs, ns, name, template, domain string, size int32) ([]corev1.Pod, *gangv1.Gang) {
	t.Helper()
	gs.create(ctx, t, &gangv1.Gang{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: gangv1.GangSpec{Size: size, DomainClaimName: domain,
			Selector: metav1.LabelSelector{MatchLabels: map[string]string{jobName: name}}},
	})
	if _, err := c.Client().BatchV1().Jobs(ns).Create(ctx, indexedJob(ns, name, size, template, domain), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.deleteJob(context.WithoutCancel(ctx), t, ns, name) })
	t.Cleanup(func() { gs.delete(context.WithoutCancel(ctx), t, ns, name) })
	pods := c.waitAllRunning(ctx, t, ns, jobName+"="+name, int(size), 3*time.Minute)
	return pods, gs.waitCondition(ctx, t, ns, name, gangv1.ConditionRunning, metav1.ConditionTrue, time.Minute)
}

// labelGang is a gang of the pods labelled gang=<name>.
func labelGang(ns, name string, size int32, domain string) *gangv1.Gang {
	return &gangv1.Gang{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: gangv1.GangSpec{Size: size, DomainClaimName: domain,
			Selector: metav1.LabelSelector{MatchLabels: map[string]string{"gang": name}}},
	}
}

// createMembers creates n gated members of a label gang, in parallel.
func (c *tesseraCluster) createMembers(ctx context.Context, t testing.TB, ns, gangName, template, domain string, n int) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() {
			_, errs[i] = c.Client().CoreV1().Pods(ns).Create(ctx, memberPod(ns, fmt.Sprintf("%s-%d", gangName, i), gangName, template, domain), metav1.CreateOptions{})
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
}

// gangPods lists the pods labelled gang=<name>.
func (c *tesseraCluster) gangPods(ctx context.Context, t testing.TB, ns, name string) []corev1.Pod {
	t.Helper()
	return c.podsBy(ctx, t, ns, "gang="+name)
}

// podsBy lists the namespace's pods of a label selector.
func (c *tesseraCluster) podsBy(ctx context.Context, t testing.TB, ns, selector string) []corev1.Pod {
	t.Helper()
	list, err := c.Client().CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: selector})
	if err != nil {
		t.Fatal(err)
	}
	return list.Items
}

// waitAllRunning waits until n pods match the selector and all run.
func (c *tesseraCluster) waitAllRunning(ctx context.Context, t testing.TB, ns, selector string, n int, timeout time.Duration) []corev1.Pod {
	t.Helper()
	var pods []corev1.Pod
	err := wait.PollUntilContextTimeout(ctx, 300*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		list, err := c.Client().CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: selector})
		if err != nil {
			return false, nil
		}
		pods = list.Items
		running := 0
		for _, p := range pods {
			if p.Status.Phase == corev1.PodRunning && p.DeletionTimestamp == nil {
				running++
			}
		}
		return len(pods) == n && running == n, nil
	})
	if err != nil {
		var b strings.Builder
		for _, p := range pods {
			fmt.Fprintf(&b, "  %s: %s node=%q gates=%v\n", p.Name, p.Status.Phase, p.Spec.NodeName, p.Spec.SchedulingGates)
		}
		t.Fatalf("not all %d pods %q running within %v:\n%sevents:\n%s", n, selector, timeout, b.String(), c.events(ctx, ns))
	}
	return pods
}

// checkHeldNothing checks that every pod is still gated and unbound and none
// of their claims (nor the domain claim) is allocated.
func (c *tesseraCluster) checkHeldNothing(ctx context.Context, t testing.TB, ns string, pods []corev1.Pod, domain string) {
	t.Helper()
	for _, p := range pods {
		if p.Spec.NodeName != "" || len(p.Spec.SchedulingGates) == 0 {
			t.Errorf("member %s of a waiting gang is bound to %q or released (gates %v)", p.Name, p.Spec.NodeName, p.Spec.SchedulingGates)
		}
		for _, s := range p.Status.ResourceClaimStatuses {
			if s.ResourceClaimName == nil {
				continue
			}
			claim, err := c.Client().ResourceV1().ResourceClaims(ns).Get(ctx, *s.ResourceClaimName, metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if claim.Status.Allocation != nil {
				t.Errorf("claim %s of waiting member %s is allocated: %+v", claim.Name, p.Name, claim.Status.Allocation.Devices.Results)
			}
		}
	}
	if domain != "" {
		claim, err := c.Client().ResourceV1().ResourceClaims(ns).Get(ctx, domain, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if claim.Status.Allocation != nil {
			t.Errorf("domain claim %s of a waiting gang is allocated: %+v", domain, claim.Status.Allocation.Devices.Results)
		}
	}
}

// cutPlacementWrote checks what a placement cut at its second claim write
// left of gang ns/name: its domain claim's channel allocated (written
// first, alone), no member's claim allocated (only the scheduler allocates
// those, after the release) and every member gated. It returns how many
// claims carry the cut placement's ID.
func (c *tesseraCluster) cutPlacementWrote(ctx context.Context, t *testing.T, ns, name, domainClaim string) int {
	t.Helper()
	dc := getClaim(ctx, t, c, ns, domainClaim)
	id := dc.Annotations[gangv1.AnnotationPlacement]
	if dc.Status.Allocation == nil || id == "" {
		t.Fatalf("domain claim %s not allocated at the interruption: the test does not exercise a cut placement", domainClaim)
	}
	written := 1
	for _, p := range c.gangPods(ctx, t, ns, name) {
		if len(p.Spec.SchedulingGates) == 0 {
			t.Errorf("member %s released by a placement cut before its commit", p.Name)
		}
		mc := getClaim(ctx, t, c, ns, *p.Status.ResourceClaimStatuses[0].ResourceClaimName)
		if mc.Status.Allocation != nil {
			t.Errorf("member %s's claim is allocated while the member is gated: only the scheduler allocates it", p.Name)
		}
		if mc.Annotations[gangv1.AnnotationPlacement] == id {
			written++
		}
	}
	return written
}

// refusedForAHeldDevice lists the pods of ns whose prepare the kubelet
// plugin refused because another claim held their device (its messages in
// driver/prepare): what a device allocated to two claims leads to.
func (c *tesseraCluster) refusedForAHeldDevice(ctx context.Context, t *testing.T, ns string) []string {
	t.Helper()
	list, err := c.Client().CoreV1().Events(ns).List(ctx, metav1.ListOptions{})
	noErr(t, err)
	var out []string
	for _, ev := range list.Items {
		if ev.Reason != "FailedPrepareDynamicResources" {
			continue
		}
		for _, held := range []string{"already prepared for claim", "is held by claim"} {
			if strings.Contains(ev.Message, held) {
				out = append(out, fmt.Sprintf("pod %s: %s", ev.InvolvedObject.Name, ev.Message))
				break
			}
		}
	}
	return out
}
