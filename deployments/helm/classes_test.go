package helm

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	admissionv1 "k8s.io/api/admission/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"

	"github.com/tessera-dev/tessera/webhook"
)

// TestShippedClassesPassTheWebhook: the webhook configuration skips every
// DeviceClass the chart installs, by exact name (they are created before the
// webhook's pod can answer; deployments/webhook
// TestOnlyTesseraClassesSkipTheWebhook), and so each must pass the webhook's
// own review, run here in-process.
func TestShippedClassesPassTheWebhook(t *testing.T) {
	h, err := webhook.NewHandler(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	classes := find[*resourceapi.DeviceClass](renderT(t, Combinations()[0]))
	configured := 0
	for _, class := range classes {
		if len(class.Spec.Config) > 0 {
			configured++
		}
		raw, err := json.Marshal(class)
		if err != nil {
			t.Fatal(err)
		}
		review := admissionv1.AdmissionReview{
			TypeMeta: metav1.TypeMeta{APIVersion: "admission.k8s.io/v1", Kind: "AdmissionReview"},
			Request: &admissionv1.AdmissionRequest{
				UID:       types.UID("review-" + class.Name),
				Kind:      metav1.GroupVersionKind{Group: "resource.k8s.io", Version: "v1", Kind: "DeviceClass"},
				Resource:  metav1.GroupVersionResource{Group: "resource.k8s.io", Version: "v1", Resource: "deviceclasses"},
				Name:      class.Name,
				Operation: admissionv1.Create,
				Object:    runtime.RawExtension{Raw: raw},
			},
		}
		body, err := json.Marshal(review)
		if err != nil {
			t.Fatal(err)
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, webhook.Path, bytes.NewReader(body)))
		var answer admissionv1.AdmissionReview
		if err := json.Unmarshal(rec.Body.Bytes(), &answer); rec.Code != http.StatusOK || err != nil || answer.Response == nil {
			t.Fatalf("DeviceClass %s: webhook answered %d %s", class.Name, rec.Code, rec.Body)
		}
		if !answer.Response.Allowed {
			t.Errorf("DeviceClass %s: the webhook refuses it: %+v", class.Name, answer.Response.Result)
		}
	}
	if len(classes) < 6 || configured == 0 {
		t.Errorf("%d classes, %d with a configuration: the chart's classes were not all reviewed", len(classes), configured)
	}
}
