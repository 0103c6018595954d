package plugin_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/klog/v2"
	"k8s.io/klog/v2/ktesting"

	"github.com/tessera-dev/tessera/driver/fakenode"
	"github.com/tessera-dev/tessera/driver/nodeopen"
	"github.com/tessera-dev/tessera/driver/plugin"
	"github.com/tessera-dev/tessera/test/kubeletsim"
)

const (
	driverName = "gpu.tessera.dev"
	nodeName   = "node-a"
)

type harness struct {
	t       *testing.T
	ctx     context.Context
	client  *fake.Clientset
	opts    plugin.Options
	plugin  *plugin.Plugin
	kubelet *kubeletsim.Kubelet
	// unregistered: startWith leaves starting the plugin to the test.
	unregistered bool
}

// shortDir keeps unix socket paths under the 108-byte limit.
func shortDir(t *testing.T) string {
	d, err := os.MkdirTemp("", "tp")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(d) })
	return d
}

// start runs the plugin on a fake node of the given profile.
func start(t *testing.T, profile string) *harness {
	return startWith(t, func(dir string, o *plugin.Options) {
		o.Node = nodeopen.Options{NodeName: nodeName, FakeNode: profile, FakeRoot: filepath.Join(dir, "host")}
	})
}

// startOnFakeNode runs the plugin on a fake node the test keeps, to drive
// or inspect its NVML; adjust, if given, changes further options.
func startOnFakeNode(t *testing.T, profile string, adjust func(o *plugin.Options), apiServer ...func(*fake.Clientset)) (*harness, *fakenode.Node) {
	t.Helper()
	var n *fakenode.Node
	h := startWith(t, func(dir string, o *plugin.Options) {
		var err error
		n, err = fakenode.New(profile, fakenode.Options{Dir: filepath.Join(dir, "host"), NodeName: nodeName})
		if err != nil {
			t.Fatal(err)
		}
		o.Node = nodeopen.Options{NodeName: nodeName, Opened: &n.Node}
		if adjust != nil {
			adjust(o)
		}
	}, apiServer...)
	return h, n
}

// startWith runs the plugin with options a test adjusts (dir is the test's
// short scratch directory), registered with a simulated kubelet, against a
// fake API server holding this node.
func startWith(t *testing.T, adjust func(dir string, o *plugin.Options), apiServer ...func(*fake.Clientset)) *harness {
	t.Helper()
	return newHarness(t, false, adjust, apiServer...)
}

// newHarness is startWith, but unless started it starts no plugin: the test
// does (plugin.Start, kubeletsim.Register).
func newHarness(t *testing.T, unregistered bool, adjust func(dir string, o *plugin.Options), apiServer ...func(*fake.Clientset)) *harness {
	t.Helper()
	// Buffered, so that a test can wait for what the plugin says (logged).
	logger := ktesting.NewLogger(t, ktesting.NewConfig(ktesting.BufferLogs(true)))
	ctx, cancel := context.WithCancel(klog.NewContext(context.Background(), logger))
	t.Cleanup(cancel)
	dir := shortDir(t)
	bootID := filepath.Join(dir, "boot_id")
	if err := os.WriteFile(bootID, []byte("boot-1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	h := &harness{t: t, ctx: ctx, unregistered: unregistered,
		client: fake.NewClientset(&v1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeName, UID: "node-uid"}}),
		opts: plugin.Options{
			CDIRoot:       filepath.Join(dir, "cdi"),
			PluginDataDir: filepath.Join(dir, "plugin"),
			RegistrarDir:  filepath.Join(dir, "reg"),
			BootIDFile:    bootID,
			KubeAPIQPS:    50, KubeAPIBurst: 100,
		},
	}
	adjust(dir, &h.opts)
	// The kubelet owns and creates its registration directory.
	if err := os.MkdirAll(h.opts.RegistrarDir, 0o750); err != nil {
		t.Fatal(err)
	}
	// The fake clientset implements neither generateName nor
	// resourceVersion on the objects it stores; a real API server does
	// both. The slice controller relies on generateName for every slice
	// after the first, and on the versions to read its own writes back
	// from its mutation cache before its informer sees them: without them
	// a second sync in that window rewrites a slice it has just written
	// (upstream Update queues the pool twice, so one often follows).
	var seq, version int
	h.client.PrependReactor("*", "resourceslices", func(action k8stesting.Action) (bool, runtime.Object, error) {
		if action.GetVerb() != "create" && action.GetVerb() != "update" {
			return false, nil, nil
		}
		// Any served version (a test may serve only older ones).
		obj, err := meta.Accessor(action.(interface{ GetObject() runtime.Object }).GetObject())
		if err != nil {
			return true, nil, err
		}
		if action.GetVerb() == "create" && obj.GetName() == "" && obj.GetGenerateName() != "" {
			seq++
			obj.SetName(fmt.Sprintf("%s%05d", obj.GetGenerateName(), seq))
		}
		version++
		obj.SetResourceVersion(strconv.Itoa(version))
		return false, nil, nil
	})
	for _, f := range apiServer {
		f(h.client)
	}
	if err := h.opts.Validate(); err != nil {
		t.Fatal(err)
	}
	if !h.unregistered {
		h.restart()
	}
	return h
}

// logged tells whether the plugin has logged a line holding every one of
// parts (through the test's logger, every verbosity the tests run with).
func (h *harness) logged(parts ...string) bool {
	h.t.Helper()
	u, ok := klog.FromContext(h.ctx).GetSink().(ktesting.Underlier)
	if !ok {
		h.t.Fatal("the test's logger keeps no buffer")
	}
	for line := range strings.Lines(u.GetBuffer().String()) {
		if !slices.ContainsFunc(parts, func(p string) bool { return !strings.Contains(line, p) }) {
			return true
		}
	}
	return false
}

// restart (re)starts the plugin process-equivalent over the same disk state
// and registers it with the simulated kubelet.
func (h *harness) restart() {
	h.t.Helper()
	if h.plugin != nil {
		h.plugin.Stop()
		_ = h.kubelet.Close()
	}
	p, err := plugin.Start(h.ctx, h.opts, h.client)
	if err != nil {
		h.t.Fatal(err)
	}
	h.plugin = p
	h.t.Cleanup(p.Stop)
	ctx, cancel := context.WithTimeout(h.ctx, 10*time.Second)
	defer cancel()
	k, err := kubeletsim.Register(ctx, h.opts.RegistrarDir)
	if err != nil {
		h.t.Fatal(err)
	}
	h.kubelet = k
	h.t.Cleanup(func() { _ = k.Close() })
}

// claim creates an allocated claim in the fake API server.
func (h *harness) claim(name string, devices ...string) kubeletsim.Claim {
	h.t.Helper()
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name, UID: types.UID("uid-" + name)}}
	c.Status.Allocation = &resourceapi.AllocationResult{}
	for i, d := range devices {
		c.Status.Allocation.Devices.Results = append(c.Status.Allocation.Devices.Results, resourceapi.DeviceRequestAllocationResult{
			Request: fmt.Sprintf("gpu%d", i), Driver: driverName, Pool: nodeName, Device: d,
		})
	}
	if _, err := h.client.ResourceV1().ResourceClaims("default").Create(h.ctx, c, metav1.CreateOptions{}); err != nil {
		h.t.Fatal(err)
	}
	return kubeletsim.Claim{Namespace: "default", Name: name, UID: c.UID}
}

func (h *harness) prepare(c kubeletsim.Claim) ([]string, string) {
	h.t.Helper()
	resp, err := h.kubelet.Prepare(h.ctx, c)
	if err != nil {
		h.t.Fatalf("NodePrepareResources: %v", err)
	}
	r := resp.Claims[string(c.UID)]
	if r == nil {
		h.t.Fatalf("no response for claim %s: %v", c.Name, resp)
	}
	var ids []string
	for _, d := range r.Devices {
		if d.PoolName != nodeName {
			h.t.Errorf("device %s in pool %q", d.DeviceName, d.PoolName)
		}
		ids = append(ids, d.DeviceName+"="+strings.Join(d.CdiDeviceIds, ","))
	}
	return ids, r.Error
}

func TestPluginRegistersAndPublishes(t *testing.T) {
	h := start(t, "dgx-h100")
	if h.kubelet.Info.Name != driverName {
		t.Errorf("registered as %q", h.kubelet.Info.Name)
	}
	// Dynamic MIG, published lazily (both on by default): 8 whole GPUs and
	// the spare's 25 partitions in one slice, plus a slice of the 8 GPUs'
	// counter sets.
	var devices, counterSets, slices int
	var want int64
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		list, err := h.client.ResourceV1().ResourceSlices().List(h.ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		devices, counterSets, slices = 0, 0, len(list.Items)
		for _, s := range list.Items {
			want = s.Spec.Pool.ResourceSliceCount
			if *s.Spec.NodeName != nodeName {
				t.Fatalf("slice %s for node %s", s.Name, *s.Spec.NodeName)
			}
			devices += len(s.Spec.Devices)
			counterSets += len(s.Spec.SharedCounters)
		}
		if slices > 0 && int64(slices) == want {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if int64(slices) != want || slices != 2 || counterSets != 8 || devices != 8+25 {
		t.Fatalf("published %d of %d slices with %d devices and %d counter sets", slices, want, devices, counterSets)
	}
}

func TestPrepareOverTheSocketIsIdempotent(t *testing.T) {
	h := start(t, "dgx-h100")
	c := h.claim("train", "gpu-0", "gpu-1")
	first, errMsg := h.prepare(c)
	if errMsg != "" || len(first) != 2 || !strings.HasPrefix(first[0], "gpu-0=gpu.tessera.dev/gpu=uid-train-") {
		t.Fatalf("prepare: %v %q", first, errMsg)
	}
	second, errMsg := h.prepare(c)
	if errMsg != "" || strings.Join(first, " ") != strings.Join(second, " ") {
		t.Fatalf("repeated prepare: %v %q, first %v", second, errMsg, first)
	}
	if _, err := os.Stat(filepath.Join(h.opts.CDIRoot, "gpu.tessera.dev-gpu_uid-train.json")); err != nil {
		t.Errorf("CDI spec: %v", err)
	}
	// A restarted plugin still knows the claim and returns the same devices.
	h.restart()
	third, errMsg := h.prepare(c)
	if errMsg != "" || strings.Join(first, " ") != strings.Join(third, " ") {
		t.Fatalf("after restart: %v %q", third, errMsg)
	}
	resp, err := h.kubelet.Unprepare(h.ctx, c)
	if err != nil || resp.Claims[string(c.UID)].Error != "" {
		t.Fatalf("unprepare: %v %v", resp, err)
	}
	if _, err := os.Stat(filepath.Join(h.opts.CDIRoot, "gpu.tessera.dev-gpu_uid-train.json")); !os.IsNotExist(err) {
		t.Errorf("CDI spec after unprepare: %v", err)
	}
	// Unprepare of a claim the plugin never saw succeeds.
	resp, err = h.kubelet.Unprepare(h.ctx, kubeletsim.Claim{Namespace: "default", Name: "ghost", UID: "uid-ghost"})
	if err != nil || resp.Claims["uid-ghost"].Error != "" {
		t.Fatalf("unprepare unknown: %v %v", resp, err)
	}
}

func TestPrepareOverTheSocketRefusesATakenGPU(t *testing.T) {
	h := start(t, "pcie-l4x4")
	if _, errMsg := h.prepare(h.claim("a", "gpu-2")); errMsg != "" {
		t.Fatal(errMsg)
	}
	_, errMsg := h.prepare(h.claim("b", "gpu-2"))
	if !strings.Contains(errMsg, "gpu-2 is already prepared for claim default/a") {
		t.Fatalf("got %q", errMsg)
	}
	// A claim missing from the API server fails the call as the kubelet sees it.
	if _, err := h.kubelet.Prepare(h.ctx, kubeletsim.Claim{Namespace: "default", Name: "nope", UID: "uid-nope"}); err == nil {
		t.Error("prepare of a claim the API server lacks succeeded")
	}
}

func TestConcurrentPreparesOverTheSocket(t *testing.T) {
	h := start(t, "dgx-h100")
	claims := make([]kubeletsim.Claim, 8)
	for i := range claims {
		claims[i] = h.claim(fmt.Sprintf("c%d", i), fmt.Sprintf("gpu-%d", i))
	}
	// Two more claims race for gpu-0: only its owner may win.
	rivals := []kubeletsim.Claim{h.claim("rival1", "gpu-0"), h.claim("rival2", "gpu-0")}
	var wg sync.WaitGroup
	var mu sync.Mutex
	failures := map[string]string{}
	for _, c := range append(claims, rivals...) {
		wg.Go(func() {
			resp, err := h.kubelet.Prepare(h.ctx, c)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				failures[c.Name] = err.Error()
			} else if e := resp.Claims[string(c.UID)].Error; e != "" {
				failures[c.Name] = e
			}
		})
	}
	wg.Wait()
	owners := 0
	for _, n := range []string{"c0", "rival1", "rival2"} {
		if _, failed := failures[n]; !failed {
			owners++
		}
	}
	if owners != 1 {
		t.Errorf("%d claims hold gpu-0: failures %v", owners, failures)
	}
	for i := 1; i < 8; i++ {
		if e, failed := failures[fmt.Sprintf("c%d", i)]; failed {
			t.Errorf("c%d failed: %s", i, e)
		}
	}
}

func TestStopRemovesTheSockets(t *testing.T) {
	h := start(t, "pcie-l4x4")
	h.plugin.Stop()
	for _, dir := range []string{h.opts.RegistrarDir, h.opts.PluginDataDir} {
		entries, _ := os.ReadDir(dir)
		for _, e := range entries {
			if e.Type()&os.ModeSocket != 0 {
				t.Errorf("socket %s left in %s", e.Name(), dir)
			}
		}
	}
}
