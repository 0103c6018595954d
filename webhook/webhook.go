// Package webhook is Tessera's validating admission webhook: it reviews the
// opaque device configurations of ResourceClaims, ResourceClaimTemplates and
// DeviceClasses with the decoder the kubelet plugin uses (api/gpu/v1alpha1),
// so that a malformed configuration is refused when it is written, naming
// the field, instead of failing a pod when its claim is prepared.
package webhook

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	admissionv1 "k8s.io/api/admission/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/validation/field"
	"k8s.io/klog/v2"

	"github.com/tessera-dev/tessera/api/gpu/v1alpha1"
)

// DriverName is the driver whose configurations are reviewed; those of other
// drivers are left alone. It is driver/slices.DriverName, not imported from
// there because that package brings NVML with it.
const DriverName = "gpu.tessera.dev"

// maxReviewBytes bounds a request body: an AdmissionReview carries the
// object and, on update, the old object, each at most the API server's
// 3 MiB request limit.
const maxReviewBytes = 8 << 20

// Handler answers AdmissionReviews (admission.k8s.io/v1) over HTTP.
type Handler struct {
	metrics *metrics
}

// NewHandler returns a handler. With reg set, it registers the webhook's
// metrics there.
func NewHandler(reg prometheus.Registerer) (*Handler, error) {
	m, err := newMetrics(reg)
	if err != nil {
		return nil, err
	}
	return &Handler{metrics: m}, nil
}

// ServeHTTP reviews one AdmissionReview. A request that is not one gets 400;
// a review of a kind the webhook does not know is allowed.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	logger := klog.FromContext(r.Context())
	if r.Method != http.MethodPost {
		w.Header().Set("Allow", http.MethodPost)
		http.Error(w, "admission reviews are POSTed", http.StatusMethodNotAllowed)
		return
	}
	review, err := readReview(http.MaxBytesReader(w, r.Body, maxReviewBytes))
	if err != nil {
		h.metrics.count("", verdictMalformed)
		logger.Info("Refusing a malformed admission review", "remoteAddr", r.RemoteAddr, "err", err)
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	req := review.Request
	logger = klog.LoggerWithValues(logger, "uid", req.UID, "kind", req.Kind.Kind, "namespace", req.Namespace, "name", req.Name, "operation", req.Operation)
	resp, err := h.review(klog.NewContext(r.Context(), logger), req)
	if err != nil {
		h.metrics.count(req.Kind.Kind, verdictMalformed)
		logger.Info("Refusing a malformed admission review", "remoteAddr", r.RemoteAddr, "err", err)
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	resp.UID = req.UID
	out, err := json.Marshal(admissionv1.AdmissionReview{TypeMeta: review.TypeMeta, Response: resp})
	if err != nil {
		logger.Error(err, "Encode admission response")
		http.Error(w, "encode admission response: "+err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(out)
}

// readReview decodes an AdmissionReview and checks it is one the webhook can
// answer.
func readReview(body io.Reader) (*admissionv1.AdmissionReview, error) {
	data, err := io.ReadAll(body)
	if err != nil {
		return nil, fmt.Errorf("read admission review: %w", err)
	}
	var review admissionv1.AdmissionReview
	if err := json.Unmarshal(data, &review); err != nil {
		return nil, fmt.Errorf("admission review is not JSON: %w", err)
	}
	want := admissionv1.SchemeGroupVersion.WithKind("AdmissionReview")
	if got := review.GroupVersionKind(); got != want {
		return nil, fmt.Errorf("got %s %s, want apiVersion %s kind %s; list only %q in the webhook configuration's admissionReviewVersions",
			got.GroupVersion(), got.Kind, want.GroupVersion(), want.Kind, want.Version)
	}
	if review.Request == nil || review.Request.UID == "" {
		return nil, errors.New("admission review has no request, or a request without uid")
	}
	return &review, nil
}

// review decides one request. An error means the request is malformed.
func (h *Handler) review(ctx context.Context, req *admissionv1.AdmissionRequest) (*admissionv1.AdmissionResponse, error) {
	logger := klog.FromContext(ctx)
	gvk := schema.GroupVersionKind(req.Kind)
	read, ok := readers[gvk]
	switch {
	case !ok:
		logger.Info("Allowing a kind this webhook does not review; check the webhook configuration's rules", "group", req.Kind.Group, "version", req.Kind.Version)
		h.metrics.count(kindOther, verdictAllowed)
		return allowed(), nil
	case req.SubResource != "" || (req.Operation != admissionv1.Create && req.Operation != admissionv1.Update):
		// Status holds configurations copied from the spec at allocation,
		// and a deletion writes none.
		logger.V(4).Info("Allowing: no configuration is written", "subResource", req.SubResource)
		h.metrics.count(req.Kind.Kind, verdictAllowed)
		return allowed(), nil
	}
	obj, err := read(req.Object.Raw)
	if err != nil {
		return nil, fmt.Errorf("object: %w", err)
	}
	// On update only what changes is held to the rules, as the API server
	// does with its own validation: an object written before the webhook
	// existed must still be updatable (a finalizer removed, a label set).
	unchanged := map[string]bool{}
	if req.Operation == admissionv1.Update {
		old, err := read(req.OldObject.Raw)
		if err != nil {
			return nil, fmt.Errorf("oldObject: %w", err)
		}
		for _, c := range old.configs {
			unchanged[c.driver+"\x00"+string(c.raw)] = true
		}
	}
	var errs field.ErrorList
	checked := 0
	for _, c := range obj.configs {
		if c.driver != DriverName || unchanged[c.driver+"\x00"+string(c.raw)] {
			continue
		}
		checked++
		_, e := v1alpha1.DecodeAt(c.raw, c.path)
		errs = append(errs, e...)
	}
	if len(errs) == 0 {
		logger.V(2).Info("Allowing", "checkedConfigs", checked)
		h.metrics.count(req.Kind.Kind, verdictAllowed)
		return allowed(), nil
	}
	if obj.name == "" {
		obj.name = req.Name
	}
	// The API server's own shape for invalid objects: 422, reason Invalid,
	// a cause per field, and a message naming the object and each field.
	status := apierrors.NewInvalid(schema.GroupKind{Group: gvk.Group, Kind: gvk.Kind}, obj.name, errs).ErrStatus
	logger.Info("Denying an invalid device configuration", "errors", errs.ToAggregate().Error())
	h.metrics.count(req.Kind.Kind, verdictDenied)
	return &admissionv1.AdmissionResponse{Allowed: false, Result: &status}, nil
}

func allowed() *admissionv1.AdmissionResponse {
	return &admissionv1.AdmissionResponse{Allowed: true, Result: &metav1.Status{Status: metav1.StatusSuccess}}
}
