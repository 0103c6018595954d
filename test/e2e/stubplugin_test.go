package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2"

	"github.com/tessera-dev/tessera/test/cluster"
)

// stubDriver is a stand-in DRA plugin that exercises the cluster harness
// (registration, prepare, CDI injection by the runtime) without Tessera's
// driver. By default it publishes two devices, "dev-0" and "dev-1". It
// prepares a claim by writing one CDI spec with a fully specified device
// node and an environment variable naming the device. Under another driver
// name it stands in for a third-party driver, e.g. a NIC's.
const stubDriver = "stub.tessera.dev"

type stubPlugin struct {
	driver string
	cdiDir string
}

// startStubPlugin runs the stub as stubDriver with devices dev-0 and dev-1.
func startStubPlugin(ctx context.Context, node *cluster.Node, client kubernetes.Interface) (*kubeletplugin.Helper, error) {
	return startStubDriver(ctx, node, client, stubDriver, []resourceapi.Device{{Name: "dev-0"}, {Name: "dev-1"}})
}

// startStubDriver runs the stub as driver on node, publishing devices.
func startStubDriver(ctx context.Context, node *cluster.Node, client kubernetes.Interface, driver string, devices []resourceapi.Device) (*kubeletplugin.Helper, error) {
	p := &stubPlugin{driver: driver, cdiDir: node.CDIDir()}
	// In a real deployment a hostPath volume (DirectoryOrCreate) makes it.
	dataDir := filepath.Join(node.PluginsDir(), driver)
	if err := os.MkdirAll(dataDir, 0o750); err != nil {
		return nil, fmt.Errorf("create plugin data dir: %w", err)
	}
	helper, err := kubeletplugin.Start(ctx, p,
		kubeletplugin.DriverName(driver),
		kubeletplugin.NodeName(node.Name()),
		kubeletplugin.KubeClient(client),
		kubeletplugin.RegistrarDirectoryPath(node.RegistrarDir()),
		kubeletplugin.PluginDataDirectoryPath(dataDir),
	)
	if err != nil {
		return nil, fmt.Errorf("start stub plugin on %s: %w", node.Name(), err)
	}
	err = helper.PublishResources(ctx, resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{
		node.Name(): {Slices: []resourceslice.Slice{{Devices: devices}}},
	}})
	if err != nil {
		helper.Stop()
		return nil, fmt.Errorf("publish stub devices on %s: %w", node.Name(), err)
	}
	return helper, nil
}

func (p *stubPlugin) specPath(uid types.UID) string {
	return filepath.Join(p.cdiDir, p.driver+"-"+string(uid)+".json")
}

func (p *stubPlugin) PrepareResourceClaims(ctx context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	results := map[types.UID]kubeletplugin.PrepareResult{}
	for _, claim := range claims {
		var devices []kubeletplugin.Device
		var cdiDevices []map[string]any
		for _, r := range claim.Status.Allocation.Devices.Results {
			if r.Driver != p.driver {
				continue
			}
			name := string(claim.UID) + "-" + r.Device
			cdiDevices = append(cdiDevices, map[string]any{
				"name": name,
				"containerEdits": map[string]any{
					"env":         []string{"STUB_DEVICE=" + r.Device},
					"deviceNodes": []map[string]any{{"path": "/dev/stub-" + r.Device, "type": "c", "major": 195, "minor": 0}},
				},
			})
			devices = append(devices, kubeletplugin.Device{
				Requests: []string{r.Request}, PoolName: r.Pool, DeviceName: r.Device,
				CDIDeviceIDs: []string{p.driver + "/dev=" + name},
			})
		}
		spec, err := json.Marshal(map[string]any{"cdiVersion": "0.6.0", "kind": p.driver + "/dev", "devices": cdiDevices})
		if err == nil {
			err = os.WriteFile(p.specPath(claim.UID), spec, 0o644)
		}
		results[claim.UID] = kubeletplugin.PrepareResult{Devices: devices, Err: err}
		klog.FromContext(ctx).Info("Stub plugin prepared claim", "claim", klog.KObj(claim), "devices", devices, "err", err)
	}
	return results, nil
}

func (p *stubPlugin) UnprepareResourceClaims(ctx context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	results := map[types.UID]error{}
	for _, claim := range claims {
		err := os.Remove(p.specPath(claim.UID))
		if os.IsNotExist(err) {
			err = nil
		}
		results[claim.UID] = err
	}
	return results, nil
}

func (p *stubPlugin) HandleError(ctx context.Context, err error, msg string) {
	klog.FromContext(ctx).Error(err, msg)
}

func (p *stubPlugin) WatchHealthStatus(context.Context, chan<- kubeletplugin.DeviceHealthReport) error {
	return kubeletplugin.ErrHealthNotSupported
}
