package plugin_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/driver/domain"
	"github.com/tessera-dev/tessera/driver/features"
	"github.com/tessera-dev/tessera/driver/plugin"
	"github.com/tessera-dev/tessera/test/kubeletsim"
)

// metadataFile is where the kubelet plugin helper keeps a request's device
// metadata, written out here rather than taken from the code under test:
// <plugin data dir>/dra-device-metadata/<namespace>_<name>/<request>/metadata.json.
func metadataFile(h *harness, claim, request string) string {
	return filepath.Join(h.opts.PluginDataDir, "dra-device-metadata", "default_"+claim, request, "metadata.json")
}

// metadataSpec is the CDI spec the helper writes to mount it.
func metadataSpec(h *harness, uid types.UID, request string) string {
	return filepath.Join(h.opts.CDIRoot, driverName+"_metadata_"+string(uid)+"_"+request+".json")
}

// attr is one attribute as the metadata file's JSON has it.
type attr struct {
	Int    *int64  `json:"int"`
	String *string `json:"string"`
}

// readMetadata decodes the first object of a metadata file's stream: the
// devices of its one request, by name, with their attributes.
func readMetadata(t *testing.T, path string) map[string]map[string]attr {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("read device metadata: %v", err)
	}
	var doc struct {
		APIVersion string `json:"apiVersion"`
		Requests   []struct {
			Devices []struct {
				Name       string          `json:"name"`
				Attributes map[string]attr `json:"attributes"`
			} `json:"devices"`
		} `json:"requests"`
	}
	if err := json.NewDecoder(bytes.NewReader(data)).Decode(&doc); err != nil {
		t.Fatalf("decode device metadata %s: %v", path, err)
	}
	if len(doc.Requests) != 1 {
		t.Fatalf("device metadata %s has %d requests, want 1:\n%s", path, len(doc.Requests), data)
	}
	out := map[string]map[string]attr{}
	for _, d := range doc.Requests[0].Devices {
		out[d.Name] = d.Attributes
	}
	return out
}

func wantString(t *testing.T, what string, attrs map[string]attr, key, want string) {
	t.Helper()
	if a, ok := attrs[key]; !ok || a.String == nil || *a.String != want {
		t.Errorf("%s: attribute %s = %+v, want %q", what, key, a, want)
	}
}

func wantInt(t *testing.T, what string, attrs map[string]attr, key string, want int64) {
	t.Helper()
	if a, ok := attrs[key]; !ok || a.Int == nil || *a.Int != want {
		t.Errorf("%s: attribute %s = %+v, want %d", what, key, a, want)
	}
}

// gone waits for the plugin to remove a file, as it does in the background
// after a restart (the stale claims' sweep).
func gone(t *testing.T, path string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		if _, err := os.Stat(path); errors.Is(err, os.ErrNotExist) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s is still there", path)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func exists(t *testing.T, path string) bool {
	t.Helper()
	_, err := os.Stat(path)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	return err == nil
}

// TestEachPreparedDeviceTellsItsWorkloadWhatItIs prepares, through the
// kubelet plugin helper's socket, a gang member's whole GPU, a dynamic MIG
// partition and a gang's domain claim on a fake DGX H100, and reads the
// device metadata files the helper mounts into their containers: each
// device's identity as NVML reports it (the GPU's UUID, the partition's
// own once created), the member's gang, rank and role, the domain's nodes.
// Each claim's response names the metadata's CDI device. The files go with
// the kubelet's unprepare, with the plugin's own unprepare of a claim gone
// from the API, and, at start, where no claim holds them.
func TestEachPreparedDeviceTellsItsWorkloadWhatItIs(t *testing.T) {
	h, n := startOnFakeNode(t, "dgx-h100", nil)

	member := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "member", UID: "uid-member", Annotations: map[string]string{
		gangv1.AnnotationGang: "default/train", gangv1.AnnotationSize: "4", gangv1.AnnotationRank: "2",
		gangv1.AnnotationRole: "worker", gangv1.AnnotationRoleRank: "1", gangv1.AnnotationRoleSize: "3",
	}}}
	member.Status.Allocation = &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{
		{Request: "gpu0", Driver: driverName, Pool: nodeName, Device: "gpu-0"},
	}}}
	dom := domainClaim("dom")
	dom.Annotations = map[string]string{
		gangv1.AnnotationGang: "default/train", gangv1.AnnotationSize: "4",
		gangv1.AnnotationNodes: gangv1.FormatNodes([]gangv1.Node{{Name: "node-a", Address: "10.0.0.1"}, {Name: "node-b", Address: "10.0.0.2"}}),
	}
	for _, c := range []*resourceapi.ResourceClaim{member, dom} {
		if _, err := h.client.ResourceV1().ResourceClaims("default").Create(h.ctx, c, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	part := h.claim("part", "gpu-7-mig-1g10gb-6")
	claims := map[string]kubeletsim.Claim{
		"member": {Namespace: "default", Name: "member", UID: member.UID},
		"dom":    {Namespace: "default", Name: "dom", UID: dom.UID},
		"part":   part,
	}
	for name, c := range claims {
		resp, err := h.kubelet.Prepare(h.ctx, c)
		if err != nil {
			t.Fatal(err)
		}
		r := resp.Claims[string(c.UID)]
		if r == nil || r.Error != "" {
			t.Fatalf("prepare %s: %+v", name, r)
		}
		for _, d := range r.Devices {
			if !slices.ContainsFunc(d.CdiDeviceIds, func(id string) bool { return id == driverName+"/metadata="+string(c.UID)+"_"+d.RequestNames[0] }) {
				t.Errorf("claim %s: device %s's CDI devices %v do not mount its metadata", name, d.DeviceName, d.CdiDeviceIds)
			}
		}
	}

	// What NVML says, read here, not through the plugin.
	gpu0, ret := n.NVML.DeviceGetHandleByIndex(0)
	if ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	uuid0, _ := gpu0.GetUUID()
	mem0, _ := gpu0.GetMemoryInfo()
	bus0, _ := gpu0.GetPciInfo()
	gpu7, _ := n.NVML.DeviceGetHandleByIndex(7)
	mig, ret := gpu7.GetMigDeviceHandleByIndex(0)
	if ret != nvml.SUCCESS {
		t.Fatalf("no MIG device on GPU 7 after the partition's prepare: %v", ret)
	}
	migUUID, _ := mig.GetUUID()

	m := readMetadata(t, metadataFile(h, "member", "gpu0"))["gpu-0"]
	wantString(t, "member's GPU", m, "uuid", uuid0)
	wantInt(t, "member's GPU", m, "memoryBytes", int64(mem0.Total))
	wantString(t, "member's GPU", m, "resource.kubernetes.io/pciBusID", fmt.Sprintf("%04x:%02x:%02x.0", bus0.Domain, bus0.Bus, bus0.Device))
	wantString(t, "member's GPU", m, "gang", "default/train")
	wantInt(t, "member's GPU", m, "gangSize", 4)
	wantInt(t, "member's GPU", m, "gangRank", 2)
	wantString(t, "member's GPU", m, "role", "worker")
	wantInt(t, "member's GPU", m, "roleRank", 1)
	wantInt(t, "member's GPU", m, "roleSize", 3)

	p := readMetadata(t, metadataFile(h, "part", "gpu0"))["gpu-7-mig-1g10gb-6"]
	wantString(t, "partition", p, "uuid", migUUID)
	wantString(t, "partition", p, "profile", "1g.10gb")
	wantInt(t, "partition", p, "placementStart", 6)
	if _, ok := p["gangRank"]; ok {
		t.Errorf("partition of no gang has a rank: %+v", p)
	}

	d := readMetadata(t, metadataFile(h, "dom", "domain"))[domain.DeviceName(0)]
	wantString(t, "domain", d, "domain", "rack-1")
	wantString(t, "domain", d, "domainKind", domain.KindTopology)
	wantInt(t, "domain", d, "channel", 0)
	wantString(t, "domain", d, "domainNodes", "node-a,node-b")
	wantInt(t, "domain", d, "gangSize", 4)

	// The kubelet's unprepare: the helper removes the files.
	if _, err := h.kubelet.Unprepare(h.ctx, claims["member"]); err != nil {
		t.Fatal(err)
	}
	if exists(t, metadataFile(h, "member", "gpu0")) || exists(t, metadataSpec(h, member.UID, "gpu0")) {
		t.Error("the member's metadata outlived the kubelet's unprepare")
	}

	// A claim deleted while the plugin was down, which the kubelet forgot,
	// and the files of a claim no checkpoint holds: the restart removes
	// both, and keeps the prepared domain claim's.
	if err := h.client.ResourceV1().ResourceClaims("default").Delete(h.ctx, "part", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	ghost := filepath.Join(h.opts.PluginDataDir, "dra-device-metadata", "default_ghost", "gpu0", "metadata.json")
	ghostSpec := metadataSpec(h, "uid-ghost", "gpu0")
	for _, f := range []string{ghost, ghostSpec} {
		if err := os.MkdirAll(filepath.Dir(f), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(f, []byte("{}"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	h.restart()
	if exists(t, ghost) || exists(t, ghostSpec) {
		t.Error("a claim no checkpoint holds kept its metadata over a restart")
	}
	gone(t, metadataFile(h, "part", "gpu0"))
	gone(t, metadataSpec(h, part.UID, "gpu0"))
	if !exists(t, metadataFile(h, "dom", "domain")) || !exists(t, metadataSpec(h, dom.UID, "domain")) {
		t.Error("the prepared domain claim lost its metadata over the restart")
	}
}

// TestWithDeviceMetadataOffNoFileIsWritten: the gate off, a prepared claim
// gets no metadata and its response no metadata CDI device.
func TestWithDeviceMetadataOffNoFileIsWritten(t *testing.T) {
	h, _ := startOnFakeNode(t, "dgx-h100", func(o *plugin.Options) {
		o.FeatureGates = features.New()
		if err := o.FeatureGates.Set("DeviceMetadata=false"); err != nil {
			t.Fatal(err)
		}
	})
	c := h.claim("whole", "gpu-0")
	ids, errMsg := h.prepare(c)
	if errMsg != "" {
		t.Fatal(errMsg)
	}
	for _, id := range ids {
		if bytes.Contains([]byte(id), []byte("/metadata=")) {
			t.Errorf("gate off, yet the claim's devices mount metadata: %v", ids)
		}
	}
	if exists(t, metadataFile(h, "whole", "gpu0")) || exists(t, metadataSpec(h, c.UID, "gpu0")) {
		t.Error("gate off, yet the claim has a metadata file")
	}
}
