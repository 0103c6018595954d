package plugin_test

import (
	"context"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/tessera-dev/tessera/component/componenttest"
	"github.com/tessera-dev/tessera/driver/plugin"
)

// TestThePluginsAPIRequestsFailAtTheirDeadline: the plugin's API client
// (every call: the claims a prepare reads, slices, MPS daemon pods, the
// stale-claim sweep) gives up on an API server that never answers at
// --kube-api-timeout instead of hanging.
func TestThePluginsAPIRequestsFailAtTheirDeadline(t *testing.T) {
	const timeout = 300 * time.Millisecond
	client, err := plugin.NewClient(plugin.Options{Kubeconfig: componenttest.HungAPIServer(t), KubeAPIQPS: 50, KubeAPIBurst: 100, KubeAPITimeout: timeout})
	if err != nil {
		t.Fatal(err)
	}
	began := time.Now()
	_, err = client.ResourceV1().ResourceClaims("default").Get(context.Background(), "c", metav1.GetOptions{})
	if took := time.Since(began); err == nil || !strings.Contains(err.Error(), "did not answer within") || took > 10*timeout {
		t.Errorf("a read from a hung API server: %v after %v, want it failed at the %v deadline", err, took, timeout)
	}
}
