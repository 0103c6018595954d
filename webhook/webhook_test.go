package webhook_test

import (
	"bytes"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	admissionv1 "k8s.io/api/admission/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2/ktesting"

	"github.com/tessera-dev/tessera/webhook"
	"github.com/tessera-dev/tessera/webhook/webhooktest"
)

// A configuration of each kind the plugin accepts, and one per rule broken.
const (
	goodGPU        = `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","mpsConfig":{"defaultActiveThreadPercentage":50,"defaultPinnedDeviceMemoryLimit":"10Gi"}},"powerLimitWatts":300}`
	goodMIG        = `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"MigDeviceConfig","sharing":{"strategy":"MPS"}}`
	unknownField   = `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","mpsConfg":{}}}`
	wrongType      = `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","powerLimitWatts":"high"}`
	percentage150  = `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","mpsConfig":{"defaultActiveThreadPercentage":150}}}`
	sharedStrategy = `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"Shared"}}`
	tpuKind        = `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"TpuConfig"}`
	v1APIVersion   = `{"apiVersion":"gpu.tessera.dev/v1","kind":"GpuConfig"}`
	migTimeSlicing = `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"MigDeviceConfig","sharing":{"strategy":"TimeSlicing"}}`
	// Another driver's parameters mean nothing to Tessera's decoder.
	foreignGarbage = `{"kind":"TpuConfig","sharing":"yes please","powerLimitWatts":"high"}`
)

const nicDriver = "nic.example.com"

type config struct{ driver, raw string }

func tessera(raw string) config { return config{webhook.DriverName, raw} }

func claimConfigs(cs []config) []resourceapi.DeviceClaimConfiguration {
	var out []resourceapi.DeviceClaimConfiguration
	for _, c := range cs {
		out = append(out, resourceapi.DeviceClaimConfiguration{DeviceConfiguration: opaque(c)})
	}
	return out
}

func opaque(c config) resourceapi.DeviceConfiguration {
	return resourceapi.DeviceConfiguration{Opaque: &resourceapi.OpaqueDeviceConfiguration{
		Driver: c.driver, Parameters: runtime.RawExtension{Raw: []byte(c.raw)},
	}}
}

func claim(cs ...config) runtime.Object {
	return &resourceapi.ResourceClaim{
		TypeMeta:   metav1.TypeMeta{APIVersion: "resource.k8s.io/v1", Kind: "ResourceClaim"},
		ObjectMeta: metav1.ObjectMeta{Name: "train", Namespace: "ml"},
		Spec:       resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Config: claimConfigs(cs)}},
	}
}

func template(cs ...config) runtime.Object {
	return &resourceapi.ResourceClaimTemplate{
		TypeMeta:   metav1.TypeMeta{APIVersion: "resource.k8s.io/v1", Kind: "ResourceClaimTemplate"},
		ObjectMeta: metav1.ObjectMeta{Name: "shared-gpu", Namespace: "ml"},
		Spec: resourceapi.ResourceClaimTemplateSpec{Spec: resourceapi.ResourceClaimSpec{
			Devices: resourceapi.DeviceClaim{Config: claimConfigs(cs)},
		}},
	}
}

func class(cs ...config) runtime.Object {
	var out []resourceapi.DeviceClassConfiguration
	for _, c := range cs {
		out = append(out, resourceapi.DeviceClassConfiguration{DeviceConfiguration: opaque(c)})
	}
	return &resourceapi.DeviceClass{
		TypeMeta:   metav1.TypeMeta{APIVersion: "resource.k8s.io/v1", Kind: "DeviceClass"},
		ObjectMeta: metav1.ObjectMeta{Name: "mps.gpu.tessera.dev"},
		Spec:       resourceapi.DeviceClassSpec{Config: out},
	}
}

// request wraps objects in an AdmissionReview as the API server sends it.
type request struct {
	op          admissionv1.Operation
	subResource string
	obj, old    runtime.Object
}

func (r request) review(t *testing.T, uid string) *admissionv1.AdmissionReview {
	t.Helper()
	raw := func(o runtime.Object) runtime.RawExtension {
		if o == nil {
			return runtime.RawExtension{}
		}
		data, err := json.Marshal(o)
		if err != nil {
			t.Fatal(err)
		}
		return runtime.RawExtension{Raw: data}
	}
	gvk := r.obj.GetObjectKind().GroupVersionKind()
	meta, _ := r.obj.(metav1.Object)
	return &admissionv1.AdmissionReview{
		TypeMeta: metav1.TypeMeta{APIVersion: "admission.k8s.io/v1", Kind: "AdmissionReview"},
		Request: &admissionv1.AdmissionRequest{
			UID:         types.UID(uid),
			Kind:        metav1.GroupVersionKind(gvk),
			Name:        meta.GetName(),
			Namespace:   meta.GetNamespace(),
			Operation:   r.op,
			SubResource: r.subResource,
			Object:      raw(r.obj),
			OldObject:   raw(r.old),
		},
	}
}

// testServer is the webhook server as main starts it, on a free loopback
// port with a certificate from a test CA, and a client that trusts only
// that CA.
type testServer struct {
	srv    *webhook.Server
	reg    *prometheus.Registry
	ca     *webhooktest.CA
	volume *webhooktest.SecretVolume
	client *http.Client
}

func startServer(t *testing.T) *testServer {
	t.Helper()
	_, ctx := ktesting.NewTestContext(t)
	ws := webhooktest.Start(ctx, t)
	client := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: ws.CA.Pool()}}}
	t.Cleanup(client.CloseIdleConnections)
	return &testServer{srv: ws.Server, reg: ws.Registry, ca: ws.CA, volume: ws.Volume, client: client}
}

func (s *testServer) post(t *testing.T, method string, body []byte) (int, []byte) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), method, "https://"+s.srv.Addr()+webhook.Path, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := s.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	out, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, out
}

// TestReviewsDeviceConfigs sends AdmissionReviews over HTTPS and checks each
// verdict: valid Tessera configurations and other drivers' are allowed,
// every broken rule is denied with a message naming the object, the full
// field path, the bad value and what is allowed.
func TestReviewsDeviceConfigs(t *testing.T) {
	s := startServer(t)
	const claimPrefix = `ResourceClaim.resource.k8s.io "train" is invalid: `
	counted := map[string]int{} // by series
	for _, tc := range []struct {
		name string
		req  request
		// wantDenied lists fragments of the denial message; none means
		// allowed.
		wantDenied []string
	}{
		{name: "valid GPU and MIG configs", req: request{op: admissionv1.Create, obj: claim(tessera(goodGPU), tessera(goodMIG))}},
		{name: "no configs", req: request{op: admissionv1.Create, obj: claim()}},
		{name: "other driver's garbage is ignored", req: request{op: admissionv1.Create, obj: claim(config{nicDriver, foreignGarbage}, tessera(goodMIG))}},
		{name: "valid template", req: request{op: admissionv1.Create, obj: template(tessera(goodGPU))}},
		{name: "valid class", req: request{op: admissionv1.Create, obj: class(tessera(goodMIG))}},
		{name: "unknown field", req: request{op: admissionv1.Create, obj: claim(tessera(unknownField))},
			wantDenied: []string{claimPrefix + "spec.devices.config[0].opaque.parameters.sharing.mpsConfg: Forbidden: unknown field \"mpsConfg\": check its spelling"}},
		{name: "wrong type", req: request{op: admissionv1.Create, obj: claim(tessera(wrongType))},
			wantDenied: []string{claimPrefix + "spec.devices.config[0].opaque.parameters.powerLimitWatts: Invalid value: got JSON string, want int32"}},
		{name: "percentage out of range", req: request{op: admissionv1.Create, obj: claim(config{nicDriver, foreignGarbage}, tessera(percentage150))},
			wantDenied: []string{claimPrefix + "spec.devices.config[1].opaque.parameters.sharing.mpsConfig.defaultActiveThreadPercentage: Invalid value: 150: must be between 1 and 100"}},
		{name: "unknown strategy", req: request{op: admissionv1.Create, obj: claim(tessera(sharedStrategy))},
			wantDenied: []string{claimPrefix + `spec.devices.config[0].opaque.parameters.sharing.strategy: Unsupported value: "Shared": supported values: "Exclusive", "TimeSlicing", "MPS"`}},
		{name: "unknown kind", req: request{op: admissionv1.Create, obj: claim(tessera(tpuKind))},
			wantDenied: []string{claimPrefix + `spec.devices.config[0].opaque.parameters.kind: Unsupported value: "TpuConfig": supported values: "GpuConfig", "MigDeviceConfig"`}},
		{name: "unknown apiVersion", req: request{op: admissionv1.Create, obj: claim(tessera(v1APIVersion))},
			wantDenied: []string{claimPrefix + `spec.devices.config[0].opaque.parameters.apiVersion: Unsupported value: "gpu.tessera.dev/v1": supported values: "gpu.tessera.dev/v1alpha1"`}},
		{name: "TimeSlicing on a MIG device", req: request{op: admissionv1.Create, obj: claim(tessera(migTimeSlicing))},
			wantDenied: []string{claimPrefix + `spec.devices.config[0].opaque.parameters.sharing.strategy: Unsupported value: "TimeSlicing": supported values: "Exclusive", "MPS"`}},
		{name: "every bad config is named", req: request{op: admissionv1.Create, obj: claim(tessera(sharedStrategy), tessera(goodGPU), tessera(percentage150))},
			wantDenied: []string{"spec.devices.config[0].opaque.parameters.sharing.strategy", "spec.devices.config[2].opaque.parameters.sharing.mpsConfig.defaultActiveThreadPercentage"}},
		{name: "template", req: request{op: admissionv1.Create, obj: template(tessera(percentage150))},
			wantDenied: []string{`ResourceClaimTemplate.resource.k8s.io "shared-gpu" is invalid: spec.spec.devices.config[0].opaque.parameters.sharing.mpsConfig.defaultActiveThreadPercentage: Invalid value: 150`}},
		{name: "class", req: request{op: admissionv1.Create, obj: class(tessera(migTimeSlicing))},
			wantDenied: []string{`DeviceClass.resource.k8s.io "mps.gpu.tessera.dev" is invalid: spec.config[0].opaque.parameters.sharing.strategy: Unsupported value: "TimeSlicing"`}},
		{name: "update adding a bad config", req: request{op: admissionv1.Update, obj: class(tessera(goodGPU), tessera(wrongType)), old: class(tessera(goodGPU))},
			wantDenied: []string{"spec.config[1].opaque.parameters.powerLimitWatts"}},
		// Written before the webhook was installed: a finalizer must still
		// come off.
		{name: "update keeping an old bad config", req: request{op: admissionv1.Update, obj: claim(tessera(wrongType)), old: claim(tessera(wrongType))}},
		{name: "status update", req: request{op: admissionv1.Update, subResource: "status", obj: claim(tessera(wrongType)), old: claim(tessera(wrongType))}},
		{name: "delete", req: request{op: admissionv1.Delete, obj: claim(tessera(wrongType))}},
		{name: "kind not reviewed", req: request{op: admissionv1.Create, obj: &resourceapi.ResourceSlice{
			TypeMeta: metav1.TypeMeta{APIVersion: "resource.k8s.io/v1", Kind: "ResourceSlice"}}}},
	} {
		kind, verdict := tc.req.obj.GetObjectKind().GroupVersionKind().Kind, "allowed"
		if kind == "ResourceSlice" {
			kind = "other"
		}
		if len(tc.wantDenied) > 0 {
			verdict = "denied"
		}
		t.Run(tc.name, func(t *testing.T) {
			counted[fmt.Sprintf("tessera_webhook_reviews_total{kind=%q,verdict=%q}", kind, verdict)]++
			uid := "uid-" + strings.ReplaceAll(tc.name, " ", "-")
			body, err := json.Marshal(tc.req.review(t, uid))
			if err != nil {
				t.Fatal(err)
			}
			code, out := s.post(t, http.MethodPost, body)
			if code != http.StatusOK {
				t.Fatalf("HTTP %d: %s", code, out)
			}
			var got admissionv1.AdmissionReview
			if err := json.Unmarshal(out, &got); err != nil {
				t.Fatalf("response is no AdmissionReview: %v\n%s", err, out)
			}
			if got.APIVersion != "admission.k8s.io/v1" || got.Kind != "AdmissionReview" || got.Response == nil {
				t.Fatalf("response is no admission.k8s.io/v1 AdmissionReview with a response:\n%s", out)
			}
			resp := got.Response
			if resp.UID != types.UID(uid) {
				t.Errorf("response uid %q, want the request's %q", resp.UID, uid)
			}
			if len(tc.wantDenied) == 0 {
				if !resp.Allowed {
					t.Fatalf("denied: %+v", resp.Result)
				}
				return
			}
			if resp.Allowed || resp.Result == nil {
				t.Fatalf("allowed, want denied with %q", tc.wantDenied)
			}
			for _, frag := range tc.wantDenied {
				if !strings.Contains(resp.Result.Message, frag) {
					t.Errorf("message\n  %s\nlacks\n  %s", resp.Result.Message, frag)
				}
			}
			// The API server's shape for an invalid object: a client (kubectl)
			// shows a cause per field.
			if resp.Result.Code != http.StatusUnprocessableEntity || resp.Result.Reason != metav1.StatusReasonInvalid ||
				resp.Result.Details == nil || len(resp.Result.Details.Causes) == 0 {
				t.Errorf("status %d %s with details %+v, want 422 Invalid with a cause per field", resp.Result.Code, resp.Result.Reason, resp.Result.Details)
			}
			for _, c := range resp.Result.Details.Causes {
				if !strings.Contains(c.Field, ".opaque.parameters") {
					t.Errorf("cause %+v does not name the configuration's field", c)
				}
			}
		})
	}

	// Every review was counted by kind and verdict.
	var want strings.Builder
	want.WriteString("# HELP tessera_webhook_reviews_total Admission reviews answered, by kind (ResourceClaim, ResourceClaimTemplate, DeviceClass, other; empty when the request was unreadable) and verdict (allowed, denied, malformed).\n")
	want.WriteString("# TYPE tessera_webhook_reviews_total counter\n")
	for _, series := range slices.Sorted(maps.Keys(counted)) {
		fmt.Fprintf(&want, "%s %d\n", series, counted[series])
	}
	if err := testutil.GatherAndCompare(s.reg, strings.NewReader(want.String()), "tessera_webhook_reviews_total"); err != nil {
		t.Error(err)
	}
}

// TestMalformedRequestsGet400 sends what is not an admission.k8s.io/v1
// AdmissionReview of a readable object; each gets 400 saying what is wrong.
func TestMalformedRequestsGet400(t *testing.T) {
	s := startServer(t)
	good := request{op: admissionv1.Create, obj: claim(tessera(goodGPU))}.review(t, "u1")
	mutate := func(f func(r *admissionv1.AdmissionReview)) []byte {
		r := good.DeepCopy()
		f(r)
		data, err := json.Marshal(r)
		if err != nil {
			t.Fatal(err)
		}
		return data
	}
	for _, tc := range []struct {
		name, method string
		body         []byte
		wantCode     int
		wantMsg      string
	}{
		{"not JSON", http.MethodPost, []byte("<xml/>"), http.StatusBadRequest, "not JSON"},
		{"v1beta1 review", http.MethodPost, mutate(func(r *admissionv1.AdmissionReview) { r.APIVersion = "admission.k8s.io/v1beta1" }), http.StatusBadRequest, "admissionReviewVersions"},
		{"no request", http.MethodPost, mutate(func(r *admissionv1.AdmissionReview) { r.Request = nil }), http.StatusBadRequest, "no request"},
		{"object of the wrong shape", http.MethodPost, mutate(func(r *admissionv1.AdmissionReview) {
			r.Request.Object.Raw = []byte(`{"spec":"a string"}`)
		}), http.StatusBadRequest, "decode ResourceClaim"},
		{"no object", http.MethodPost, mutate(func(r *admissionv1.AdmissionReview) { r.Request.Object.Raw = nil }), http.StatusBadRequest, "object"},
		{"GET", http.MethodGet, nil, http.StatusMethodNotAllowed, "POST"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, out := s.post(t, tc.method, tc.body)
			if code != tc.wantCode || !strings.Contains(string(out), tc.wantMsg) {
				t.Errorf("HTTP %d %q, want %d with %q", code, out, tc.wantCode, tc.wantMsg)
			}
		})
	}
}
