package plugin_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	k8stesting "k8s.io/client-go/testing"
)

func specExists(h *harness, uid string) bool {
	_, err := os.Stat(filepath.Join(h.opts.CDIRoot, "gpu.tessera.dev-gpu_"+uid+".json"))
	return err == nil
}

// TestClaimsDeletedWhileThePluginWasDownAreUnprepared: the API server is the
// source of truth for which prepared claims still exist.
func TestClaimsDeletedWhileThePluginWasDownAreUnprepared(t *testing.T) {
	h := start(t, "pcie-l4x4")
	gone, kept := h.claim("gone", "gpu-0"), h.claim("kept", "gpu-1")
	if _, msg := h.prepare(gone); msg != "" {
		t.Fatal(msg)
	}
	if _, msg := h.prepare(kept); msg != "" {
		t.Fatal(msg)
	}
	h.plugin.Stop()
	if err := h.client.ResourceV1().ResourceClaims("default").Delete(h.ctx, "gone", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	h.restart()
	// The unprepare runs in the background: wait for both of its steps, the
	// claim leaving the plugin's record and its CDI spec being removed. A
	// whole-GPU claim has nothing else to undo, so its record goes first
	// (in the unprepare's one checkpoint write) and the spec after it.
	stillPrepared := func() bool {
		_, ok := h.plugin.Manager().PreparedClaims()["uid-gone"]
		return ok || specExists(h, "uid-gone")
	}
	deadline := time.Now().Add(10 * time.Second)
	for stillPrepared() && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if specExists(h, "uid-gone") {
		t.Fatal("the deleted claim's CDI spec is still there")
	}
	prepared := h.plugin.Manager().PreparedClaims()
	if _, ok := prepared["uid-gone"]; ok {
		t.Error("the deleted claim is still prepared")
	}
	if _, ok := prepared["uid-kept"]; !ok || !specExists(h, "uid-kept") {
		t.Error("a claim the API server still has was unprepared")
	}
}

// TestNothingIsUnpreparedWhenTheAPIServerIsUnreachable: not knowing is not
// a reason to take a running pod's GPU away.
func TestNothingIsUnpreparedWhenTheAPIServerIsUnreachable(t *testing.T) {
	h := start(t, "pcie-l4x4")
	c := h.claim("held", "gpu-2")
	if _, msg := h.prepare(c); msg != "" {
		t.Fatal(msg)
	}
	h.plugin.Stop()
	if err := h.client.ResourceV1().ResourceClaims("default").Delete(h.ctx, "held", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	gets := make(chan struct{}, 100)
	h.client.PrependReactor("get", "resourceclaims", func(k8stesting.Action) (bool, runtime.Object, error) {
		select {
		case gets <- struct{}{}:
		default:
		}
		return true, nil, errors.New("connection refused")
	})
	h.restart()
	select {
	case <-gets:
	case <-time.After(10 * time.Second):
		t.Fatal("the plugin never asked the API server about its prepared claim")
	}
	// The sweep reports its pass once every claim is decided on: a wrong
	// unprepare would have come before.
	checked := []string{"Checked the prepared claims against the API server", "held=1 ", "unknown=1"}
	if err := wait.PollUntilContextTimeout(h.ctx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		return h.logged(checked...), nil
	}); err != nil {
		t.Fatalf("the sweep never reported its pass as %q: %v", checked, err)
	}
	if _, ok := h.plugin.Manager().PreparedClaims()["uid-held"]; !ok || !specExists(h, "uid-held") {
		t.Error("a claim was unprepared because the API server could not be reached")
	}
}
