package plugin_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"go.etcd.io/etcd/client/pkg/v3/fileutil"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"

	"github.com/tessera-dev/tessera/driver/nodelock"
)

// lockProbe is a DRA plugin that reports, from inside a prepare call,
// whether the node lock can be taken.
type lockProbe struct {
	path string
	seen chan error
}

func (p *lockProbe) PrepareResourceClaims(_ context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	f, err := fileutil.TryLockFile(p.path, os.O_RDWR|os.O_CREATE, 0o600)
	if err == nil {
		_ = f.Close()
	}
	p.seen <- err
	out := map[types.UID]kubeletplugin.PrepareResult{}
	for _, c := range claims {
		out[c.UID] = kubeletplugin.PrepareResult{}
	}
	return out, nil
}

func (p *lockProbe) UnprepareResourceClaims(context.Context, []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	return nil, nil
}

func (p *lockProbe) HandleError(context.Context, error, string) {}

func (p *lockProbe) WatchHealthStatus(context.Context, chan<- kubeletplugin.DeviceHealthReport) error {
	return kubeletplugin.ErrHealthNotSupported
}

// TestTheNodeLockIsKubeletpluginsCallLock pins an unexported upstream
// convention: kubeletplugin, serialising calls in rolling-update mode (as
// this plugin's earlier releases had it do), holds the very file lock that
// is the node lock (driver/nodelock), so that an instance of such a release
// and one of this release exclude each other during the update between
// them. It fails when kubeletplugin names or places its lock file
// differently.
func TestTheNodeLockIsKubeletpluginsCallLock(t *testing.T) {
	h := start(t, "pcie-l4x4") // for its API server, directories and claims
	dir := shortDir(t)
	probe := &lockProbe{path: filepath.Join(dir, nodelock.NodeFile), seen: make(chan error, 1)}
	reg := filepath.Join(dir, "reg")
	if err := os.MkdirAll(reg, 0o750); err != nil {
		t.Fatal(err)
	}
	helper, err := kubeletplugin.Start(h.ctx, probe,
		kubeletplugin.DriverName(driverName), kubeletplugin.NodeName(nodeName), kubeletplugin.KubeClient(h.client),
		kubeletplugin.RegistrarDirectoryPath(reg), kubeletplugin.PluginDataDirectoryPath(dir),
		kubeletplugin.RollingUpdate("earlier-release"), kubeletplugin.Serialize(true))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(helper.Stop)
	k := connectInstanceAt(t, h, reg, "earlier-release")
	if _, err := k.Prepare(h.ctx, h.claim("probe", "gpu-0")); err != nil {
		t.Fatal(err)
	}
	if err := <-probe.seen; !errors.Is(err, fileutil.ErrLocked) {
		t.Fatalf("during a serialised call the node lock %s could be taken (%v): kubeletplugin no longer locks that file", probe.path, err)
	}
}
