package e2e

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2/ktesting"
	"sigs.k8s.io/yaml"

	webhookconfig "github.com/tessera-dev/tessera/deployments/webhook"
	"github.com/tessera-dev/tessera/test/cluster"
	"github.com/tessera-dev/tessera/webhook"
	"github.com/tessera-dev/tessera/webhook/webhooktest"
)

// TestWebhookRefusesMalformedConfigsOnTheRealAPIServer runs the webhook
// in-process over HTTPS and installs the operators' webhook configuration
// (deployments/webhook, pointed at the in-process server) on a real API
// server: claims, templates and classes with a malformed Tessera
// configuration are refused with the webhook's message naming the field;
// valid ones are accepted; objects with only another driver's configuration
// never reach the webhook.
func TestWebhookRefusesMalformedConfigsOnTheRealAPIServer(t *testing.T) {
	t.Parallel()
	c := cluster.StartT(t, cluster.Options{}) // no nodes: nothing is scheduled
	_, ctx := ktesting.NewTestContext(t)
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	client := c.Client()

	srv := webhooktest.Start(ctx, t)
	ca := srv.CA

	var vwc admissionregistrationv1.ValidatingWebhookConfiguration
	if err := yaml.UnmarshalStrict(webhookconfig.Configuration, &vwc); err != nil {
		t.Fatalf("deployments/webhook/webhook.yaml: %v", err)
	}
	url := "https://" + srv.Addr() + webhook.Path
	for i := range vwc.Webhooks {
		vwc.Webhooks[i].ClientConfig = admissionregistrationv1.WebhookClientConfig{URL: &url, CABundle: ca.PEM}
	}
	const ns = "webhook"
	if err := c.CreateNamespace(ctx, ns); err != nil {
		t.Fatal(err)
	}
	configured := time.Now()
	if _, err := client.AdmissionregistrationV1().ValidatingWebhookConfigurations().Create(ctx, &vwc, metav1.CreateOptions{}); err != nil {
		t.Fatalf("install the webhook configuration: %v", err)
	}

	const (
		percentage150  = `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","mpsConfig":{"defaultActiveThreadPercentage":150}}}`
		unknownField   = `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","mpsConfg":{}}}`
		migTimeSlicing = `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"MigDeviceConfig","sharing":{"strategy":"TimeSlicing"}}`
		valid          = `{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","mpsConfig":{"defaultActiveThreadPercentage":50}}}`
		foreign        = `{"anything":"the other driver wants"}`
	)

	// The API server picks a new webhook configuration up asynchronously:
	// until then a bad claim is accepted (and deleted again here).
	bad := webhookClaim("bad-claim", driverName, percentage150)
	var refusal error
	attempts := 0
	err := wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		attempts++
		if _, refusal = client.ResourceV1().ResourceClaims(ns).Create(ctx, bad, metav1.CreateOptions{}); refusal == nil {
			return false, client.ResourceV1().ResourceClaims(ns).Delete(ctx, bad.Name, metav1.DeleteOptions{})
		}
		return true, nil
	})
	if err != nil {
		t.Fatalf("a claim with a malformed Tessera config is still accepted 30 s after the webhook configuration was created: %v", err)
	}
	t.Logf("the API server refused the first bad claim %v after the webhook configuration was created (attempt %d): %v",
		time.Since(configured).Round(time.Millisecond), attempts, refusal)

	expectRefused(t, "claim", refusal, "resourceclaims.gpu.tessera.dev", `ResourceClaim.resource.k8s.io "bad-claim" is invalid`,
		"spec.devices.config[0].opaque.parameters.sharing.mpsConfig.defaultActiveThreadPercentage", "150", "between 1 and 100")

	_, err = client.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, webhookTemplate("bad-template", unknownField), metav1.CreateOptions{})
	expectRefused(t, "template", err, "resourceclaimtemplates.gpu.tessera.dev", `ResourceClaimTemplate.resource.k8s.io "bad-template" is invalid`,
		"spec.spec.devices.config[0].opaque.parameters.sharing.mpsConfg", `unknown field "mpsConfg"`)

	_, err = client.ResourceV1().DeviceClasses().Create(ctx, webhookClass("bad-class", migTimeSlicing), metav1.CreateOptions{})
	expectRefused(t, "class", err, "deviceclasses.gpu.tessera.dev", `DeviceClass.resource.k8s.io "bad-class" is invalid`,
		"spec.config[0].opaque.parameters.sharing.strategy", `"TimeSlicing"`, `supported values: "Exclusive", "MPS"`)

	if _, err := client.ResourceV1().ResourceClaims(ns).Create(ctx, webhookClaim("good-claim", driverName, valid), metav1.CreateOptions{}); err != nil {
		t.Errorf("valid claim refused: %v", err)
	}
	if _, err := client.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, webhookTemplate("good-template", valid), metav1.CreateOptions{}); err != nil {
		t.Errorf("valid template refused: %v", err)
	}
	class, err := client.ResourceV1().DeviceClasses().Create(ctx, webhookClass("good-class", valid), metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("valid class refused: %v", err)
	}

	// An update that brings a bad configuration is refused too.
	class.Spec.Config = append(class.Spec.Config, webhookClass("", percentage150).Spec.Config...)
	_, err = client.ResourceV1().DeviceClasses().Update(ctx, class, metav1.UpdateOptions{})
	expectRefused(t, "class update", err, "deviceclasses.gpu.tessera.dev", "spec.config[1].opaque.parameters.sharing.mpsConfig.defaultActiveThreadPercentage")

	// The matchConditions keep other drivers' claims away from the webhook.
	before := reviewCount(t, srv.Registry)
	if _, err := client.ResourceV1().ResourceClaims(ns).Create(ctx, webhookClaim("other-driver", "nic.example.com", foreign), metav1.CreateOptions{}); err != nil {
		t.Errorf("claim with another driver's config refused: %v", err)
	}
	if after := reviewCount(t, srv.Registry); after != before {
		t.Errorf("the webhook reviewed %v requests for a claim without a Tessera config; the matchConditions should keep it away", after-before)
	}
}

// expectRefused checks that the API server refused an object with the
// webhook's message: 422 Invalid, naming the webhook, the object and each
// fragment (field path, bad value, what is allowed).
func expectRefused(t *testing.T, what string, err error, webhookName string, fragments ...string) {
	t.Helper()
	if err == nil {
		t.Errorf("%s: accepted, want refused by the webhook", what)
		return
	}
	if !apierrors.IsInvalid(err) {
		t.Errorf("%s: %v (reason %s), want 422 Invalid", what, err, apierrors.ReasonForError(err))
	}
	for _, f := range append([]string{`admission webhook "` + webhookName + `" denied the request`}, fragments...) {
		if !strings.Contains(err.Error(), f) {
			t.Errorf("%s: error\n  %v\nlacks\n  %s", what, err, f)
		}
	}
}

func reviewCount(t *testing.T, reg *prometheus.Registry) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var n float64
	for _, f := range families {
		if f.GetName() == "tessera_webhook_reviews_total" {
			for _, m := range f.GetMetric() {
				n += m.GetCounter().GetValue()
			}
		}
	}
	return n
}

func webhookOpaque(driver, raw string) resourceapi.DeviceConfiguration {
	return resourceapi.DeviceConfiguration{Opaque: &resourceapi.OpaqueDeviceConfiguration{
		Driver: driver, Parameters: runtime.RawExtension{Raw: []byte(raw)},
	}}
}

func webhookClaimSpec(driver, raw string) resourceapi.ResourceClaimSpec {
	return resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
		Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: driverName}}},
		Config:   []resourceapi.DeviceClaimConfiguration{{DeviceConfiguration: webhookOpaque(driver, raw)}},
	}}
}

func webhookClaim(name, driver, raw string) *resourceapi.ResourceClaim {
	return &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: webhookClaimSpec(driver, raw)}
}

func webhookTemplate(name, raw string) *resourceapi.ResourceClaimTemplate {
	return &resourceapi.ResourceClaimTemplate{ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: resourceapi.ResourceClaimTemplateSpec{Spec: webhookClaimSpec(driverName, raw)}}
}

func webhookClass(name, raw string) *resourceapi.DeviceClass {
	return &resourceapi.DeviceClass{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: resourceapi.DeviceClassSpec{
		Config: []resourceapi.DeviceClassConfiguration{{DeviceConfiguration: webhookOpaque(driverName, raw)}},
	}}
}
