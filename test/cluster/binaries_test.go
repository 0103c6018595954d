package cluster

import (
	"os"
	"regexp"
	"testing"
)

// TestVersionsMatchK8sbinModules keeps the versions the launcher looks for in
// step with the versions test/k8sbin/build.sh builds.
func TestVersionsMatchK8sbinModules(t *testing.T) {
	for _, tc := range []struct{ gomod, module, want string }{
		{"../k8sbin/go.mod", "k8s.io/kubernetes", KubernetesVersion},
		{"../k8sbin/etcd/go.mod", "go.etcd.io/etcd/server/v3", EtcdVersion},
		{"../k8sbin/containerd/go.mod", "github.com/containerd/containerd/v2", ContainerdVersion},
		{"../k8sbin/cni/go.mod", "github.com/containernetworking/plugins", CNIPluginsVersion},
	} {
		data, err := os.ReadFile(tc.gomod)
		if err != nil {
			t.Fatal(err)
		}
		m := regexp.MustCompile(`(?m)^\s*(?:require\s+)?` + regexp.QuoteMeta(tc.module) + `\s+(\S+)`).FindSubmatch(data)
		if m == nil {
			t.Fatalf("%s does not require %s", tc.gomod, tc.module)
		}
		if got := string(m[1]); got != tc.want {
			t.Errorf("%s requires %s %s, the launcher looks for %s", tc.gomod, tc.module, got, tc.want)
		}
	}
}
