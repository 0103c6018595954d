package controller

import (
	"context"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/component/componenttest"
)

// TestTheControllersAPIRequestsFailAtTheirDeadline: every client the
// controller builds (typed, dynamic, discovery; informers and leader
// election use them) gives up on an API server that never answers at
// --kube-api-timeout instead of hanging. (Informers then retry, and wait for
// their caches meanwhile.)
func TestTheControllersAPIRequestsFailAtTheirDeadline(t *testing.T) {
	const timeout = 300 * time.Millisecond
	o := Options{Kubeconfig: componenttest.HungAPIServer(t), KubeAPIQPS: 50, KubeAPIBurst: 100, KubeAPITimeout: timeout}
	cfg, err := o.restConfig()
	if err != nil {
		t.Fatal(err)
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for name, call := range map[string]func() error{
		"a list of pods": func() error {
			_, err := client.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
			return err
		},
		"a read of a gang": func() error {
			_, err := dyn.Resource(gangv1.GroupVersionResource).Namespace("default").Get(ctx, "g", metav1.GetOptions{})
			return err
		},
		"discovery": func() error {
			_, err := client.Discovery().ServerResourcesForGroupVersion("v1")
			return err
		},
	} {
		began := time.Now()
		err := call()
		if took := time.Since(began); err == nil || !strings.Contains(err.Error(), "did not answer within") || took > 10*timeout {
			t.Errorf("%s from a hung API server: %v after %v, want it failed at the %v deadline", name, err, took, timeout)
		}
	}
}
