package component_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/tessera-dev/tessera/component"
	"github.com/tessera-dev/tessera/component/componenttest"
)

// within runs call and fails the test unless it fails within limit, naming
// the deadline.
func within(t *testing.T, limit time.Duration, what string, call func() error) {
	t.Helper()
	began := time.Now()
	err := call()
	took := time.Since(began)
	if err == nil || !strings.Contains(err.Error(), "did not answer within") {
		t.Errorf("%s on a hung API server: %v, want it failed naming the deadline", what, err)
	}
	if took > limit {
		t.Errorf("%s on a hung API server took %v, more than %v", what, took, limit)
	}
}

// TestARequestToAHungAPIServerFailsAtItsDeadline: a read and a watch that
// the server never answers fail at the client's deadline, not never.
func TestARequestToAHungAPIServerFailsAtItsDeadline(t *testing.T) {
	const timeout = 300 * time.Millisecond
	cfg, err := component.RESTConfig(componenttest.HungAPIServer(t), 50, 100, "test", timeout)
	if err != nil {
		t.Fatal(err)
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	within(t, 10*timeout, "a GET", func() error {
		_, err := client.CoreV1().Pods("default").Get(ctx, "p", metav1.GetOptions{})
		return err
	})
	within(t, 10*timeout, "a watch", func() error {
		w, err := client.CoreV1().Pods("default").Watch(ctx, metav1.ListOptions{})
		if err == nil {
			w.Stop()
		}
		return err
	})
}

// TestAWatchStreamsPastTheDeadline: the deadline bounds a watch's first
// response only; its events keep coming after it.
func TestAWatchStreamsPastTheDeadline(t *testing.T) {
	const timeout = 200 * time.Millisecond
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		select {
		case <-time.After(3 * timeout):
		case <-r.Context().Done():
			return
		}
		fmt.Fprintln(w, `{"type":"ADDED","object":{"apiVersion":"v1","kind":"Pod","metadata":{"name":"late","namespace":"default","resourceVersion":"2"}}}`)
		w.(http.Flusher).Flush()
		<-r.Context().Done()
	}))
	defer srv.Close()
	cfg, err := component.RESTConfig(componenttest.Kubeconfig(t, srv.URL), 50, 100, "test", timeout)
	if err != nil {
		t.Fatal(err)
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	w, err := client.CoreV1().Pods("default").Watch(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	select {
	case ev, ok := <-w.ResultChan():
		if !ok || ev.Type != "ADDED" {
			t.Fatalf("watch ended or failed past the deadline: %+v (open %v)", ev, ok)
		}
	case <-time.After(20 * timeout):
		t.Fatal("no event")
	}
}
