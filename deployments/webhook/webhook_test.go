package webhook_test

import (
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/google/cel-go/cel"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	"sigs.k8s.io/yaml"

	webhookconfig "github.com/tessera-dev/tessera/deployments/webhook"
	"github.com/tessera-dev/tessera/deviceclass"
)

// TestOnlyTesseraClassesSkipTheWebhook: the match condition that spares
// Tessera's own DeviceClasses the webhook (they are installed before its pod
// serves) names exactly the classes package deviceclass ships. Anyone who
// may write DeviceClasses can pick any other name, so a name that merely
// looks like Tessera's (xgpu.tessera.dev, evil.gpu.tessera.dev) is reviewed
// like any other.
func TestOnlyTesseraClassesSkipTheWebhook(t *testing.T) {
	names := shippedClasses(t)
	skips := compileExemption(t)

	for _, name := range names {
		if !skips(name) {
			t.Errorf("DeviceClass %s (package deviceclass) is sent to the webhook; the install would wait for the webhook's pod", name)
		}
	}
	var lookalikes []string
	for _, name := range names {
		lookalikes = append(lookalikes, "x"+name, "evil."+name, name+".example")
	}
	lookalikes = append(lookalikes, "tessera.dev", "example.com", "")
	for _, name := range lookalikes {
		if skips(name) && !slices.Contains(names, name) {
			t.Errorf("DeviceClass %q skips the webhook, but package deviceclass ships no class of that name", name)
		}
	}
}

// compileExemption returns the not-a-tessera-class match condition of the
// DeviceClass webhook as a function: whether a class of that name skips the
// webhook.
func compileExemption(t *testing.T) func(name string) bool {
	t.Helper()
	expr := exemption(t)
	// The variables the API server gives match conditions; the condition
	// uses only object.
	env, err := cel.NewEnv(cel.Variable("object", cel.DynType), cel.Variable("oldObject", cel.DynType), cel.Variable("request", cel.DynType))
	if err != nil {
		t.Fatal(err)
	}
	ast, iss := env.Compile(expr)
	if iss.Err() != nil {
		t.Fatalf("match condition %q: %v", expr, iss.Err())
	}
	prg, err := env.Program(ast)
	if err != nil {
		t.Fatal(err)
	}
	return func(name string) bool {
		t.Helper()
		out, _, err := prg.Eval(map[string]any{"object": map[string]any{"metadata": map[string]any{"name": name}}})
		if err != nil {
			t.Fatalf("match condition %q for %q: %v", expr, name, err)
		}
		sent, ok := out.Value().(bool)
		if !ok {
			t.Fatalf("match condition %q for %q: %v, want a bool", expr, name, out)
		}
		// All conditions true: the object is sent to the webhook.
		return !sent
	}
}

// TestExemptionListsTheShippedClasses: the not-a-tessera-class condition is
// written out from package deviceclass, so a class added there without the
// condition, or a condition naming a class no longer shipped, fails here
// with the expression to paste.
func TestExemptionListsTheShippedClasses(t *testing.T) {
	var quoted []string
	for _, name := range shippedClasses(t) {
		quoted = append(quoted, strconv.Quote(name))
	}
	want := "!(object.metadata.name in [" + strings.Join(quoted, ", ") + "])"
	if got := exemption(t); got != want {
		t.Errorf("match condition not-a-tessera-class is\n  %s\nwant (from package deviceclass)\n  %s", got, want)
	}
}

// shippedClasses are the names of package deviceclass's classes, sorted.
func shippedClasses(t *testing.T) []string {
	t.Helper()
	classes, err := deviceclass.All()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, c := range classes {
		names = append(names, c.Name)
	}
	if len(names) == 0 {
		t.Fatal("package deviceclass ships no classes")
	}
	return names
}

// exemption is the expression of the DeviceClass webhook's match condition
// not-a-tessera-class.
func exemption(t *testing.T) string {
	t.Helper()
	var cfg admissionregistrationv1.ValidatingWebhookConfiguration
	if err := yaml.UnmarshalStrict(webhookconfig.Configuration, &cfg); err != nil {
		t.Fatal(err)
	}
	for _, w := range cfg.Webhooks {
		for _, c := range w.MatchConditions {
			if w.Name == "deviceclasses.gpu.tessera.dev" && c.Name == "not-a-tessera-class" {
				return c.Expression
			}
		}
	}
	t.Fatal("webhook deviceclasses.gpu.tessera.dev has no match condition not-a-tessera-class")
	return ""
}
