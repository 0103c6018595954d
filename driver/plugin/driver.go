// Package plugin is Tessera's kubelet plugin: it wires discovery, slices and
// the prepare state machine to the kubelet through kubeletplugin. The DRAPlugin
// implementation below only delegates; the work lives in the packages it calls.
package plugin

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"

	"github.com/tessera-dev/tessera/driver/devicemeta"
	"github.com/tessera-dev/tessera/driver/domain"
	"github.com/tessera-dev/tessera/driver/health"
	"github.com/tessera-dev/tessera/driver/prepare"
)

// Driver implements kubeletplugin.DRAPlugin.
type Driver struct {
	claims *prepare.Manager
	// domains prepares claims allocated to gang domain devices.
	domains *domain.Preparer
	// fatal cancels the plugin when a background error cannot be retried.
	fatal context.CancelCauseFunc
	// health is nil when the DeviceHealth gate is off.
	health *health.Monitor
	// pool names the node's pool in health reports.
	pool string
	// metrics count prepares and unprepares; nil means none.
	metrics *claimMetrics
	// refused carries the features whose fields the API server drops
	// (partitionable devices, consumable capacity): the publisher then
	// stops offering what needs them.
	refused chan []string
	// lazy is nil unless MIG partitions are published lazily; a prepare
	// pins its devices there while it runs.
	lazy *lazyMIG
	// metadata fills each prepared device's Metadata (DeviceMetadata gate),
	// which the kubelet plugin helper writes for the claim's containers.
	metadata bool
}

var _ kubeletplugin.DRAPlugin = (*Driver)(nil)

// PrepareResourceClaims prepares each claim independently; one claim's
// failure does not fail the others.
func (d *Driver) PrepareResourceClaims(ctx context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	out := make(map[types.UID]kubeletplugin.PrepareResult, len(claims))
	for _, c := range claims {
		began := time.Now()
		devs, err := d.prepare(ctx, c)
		d.metrics.prepared(err, time.Since(began))
		out[c.UID] = kubeletplugin.PrepareResult{Devices: devs, Err: err}
	}
	return out, nil
}

// UnprepareResourceClaims releases each claim; unknown claims succeed.
func (d *Driver) UnprepareResourceClaims(ctx context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	out := make(map[types.UID]error, len(claims))
	for _, c := range claims {
		began := time.Now()
		err := d.claims.Unprepare(ctx, c.UID)
		if d.lazy != nil {
			d.lazy.heldChanged()
		}
		if err == nil {
			err = d.domains.Unprepare(c.UID)
		}
		d.metrics.unprepared(err, time.Since(began))
		out[c.UID] = err
	}
	return out, nil
}

// prepare hands a claim on gang domain devices to the domain preparer
// (recorded by the state machine, so that a restart tells its spec from an
// orphan), refuses a device on a lost GPU (health.go), else delegates.
func (d *Driver) prepare(ctx context.Context, c *resourceapi.ResourceClaim) ([]kubeletplugin.Device, error) {
	// In flight from the kubelet's call to the answer, refusals included.
	defer d.metrics.preparing()()
	if domain.Has(d.domains.Driver, c) {
		devs, err := d.claims.PrepareDomain(ctx, c, d.domains.Prepare)
		if err != nil || !d.metadata {
			return devs, err
		}
		return devicemeta.DescribeDomain(c, devs)
	}
	if err := d.refuseLost(ctx, c); err != nil {
		return nil, err
	}
	if d.lazy != nil {
		defer d.lazy.pin(c)()
	}
	devs, err := d.claims.Prepare(ctx, c)
	if err != nil || !d.metadata {
		return devs, err
	}
	rec, _ := d.claims.Record(c.UID)
	return devicemeta.Describe(d.claims.Inventory(), c, rec.Devices, devs)
}

// HandleError logs background errors; unrecoverable ones stop the plugin so
// that the DaemonSet restarts it.
func (d *Driver) HandleError(ctx context.Context, err error, msg string) {
	var dropped *resourceslice.DroppedFieldsError
	if errors.As(err, &dropped) {
		features := dropped.DisabledFeatures()
		if dropsFields(features, "DRAPartitionableDevices") {
			// An API server without partitionable devices strips the MIG
			// counters: the scheduler could then hand out overlapping
			// partitions. Stop offering them at once.
			err = fmt.Errorf("%w: the API server does not serve partitionable devices; falling back to publishing the MIG devices an operator creates (as with --feature-gates=DynamicMIG=false); enable DRAPartitionableDevices on the API server for dynamic MIG", err)
		}
		if dropsFields(features, "DRAConsumableCapacity") {
			// Without consumable capacity a shared GPU would look like an
			// exclusive one and the scheduler would hand it out whole.
			err = fmt.Errorf("%w: the API server does not serve consumable capacity; publishing shared GPUs (--time-sliced-gpus, --memory-shared-gpus) as whole GPUs instead; enable DRAConsumableCapacity on the API server (Kubernetes 1.34+) to share them", err)
		}
		select {
		case d.refused <- features:
		default:
		}
	}
	runtime.HandleErrorWithContext(ctx, err, msg)
	if !errors.Is(err, kubeletplugin.ErrRecoverable) && d.fatal != nil {
		d.fatal(err)
	}
}

// WatchHealthStatus streams every device's health to the kubelet: the full
// state at once, again on every change, and at least every resend interval
// so that the kubelet's lease never runs out (health.go).
func (d *Driver) WatchHealthStatus(ctx context.Context, reports chan<- kubeletplugin.DeviceHealthReport) error {
	if d.health == nil {
		return kubeletplugin.ErrHealthNotSupported
	}
	return streamHealth(ctx, d.health, d.pool, reports)
}

// dropsFields says whether the API server's disabled features include
// feature.
func dropsFields(disabled []string, feature string) bool { return slices.Contains(disabled, feature) }
