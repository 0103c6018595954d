package plugin

import (
	"context"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
)

// staleInterval is how often prepared claims are checked against the API.
const staleInterval = time.Minute

// unprepareStale unprepares claims this node holds that the API server says
// are gone: deleted (or replaced under the same name) or no longer
// allocated, for example while the plugin was down and the kubelet forgot
// them. The API server is the source of truth; when it cannot be asked,
// nothing is unprepared. Runs at start and then every staleInterval.
func (p *Plugin) unprepareStale(ctx context.Context, client kubernetes.Interface) {
	wait.UntilWithContext(ctx, func(ctx context.Context) {
		logger := klog.FromContext(ctx)
		unlock, err := p.driver.shared.lock()
		if err != nil {
			logger.Error(err, "Cannot check prepared claims against the API server")
			return
		}
		defer unlock()
		if err := p.driver.reloadShared(ctx); err != nil {
			logger.Error(err, "Cannot check prepared claims against the API server")
			return
		}
		for uid, c := range p.driver.claims.PreparedClaims() {
			claim, err := client.ResourceV1().ResourceClaims(c.Namespace).Get(ctx, c.Name, metav1.GetOptions{})
			switch {
			case apierrors.IsNotFound(err):
			case err != nil:
				logger.V(2).Info("Cannot check a prepared claim against the API server; keeping it", "claim", klog.KRef(c.Namespace, c.Name), "err", err)
				continue
			case claim.UID != uid || claim.Status.Allocation == nil:
			default:
				continue
			}
			logger.Info("Unpreparing a claim the API server no longer has allocated", "claim", klog.KRef(c.Namespace, c.Name), "uid", uid)
			if err := p.driver.claims.Unprepare(ctx, uid); err != nil {
				logger.Error(err, "Unprepare of a stale claim failed; retrying later", "claim", klog.KRef(c.Namespace, c.Name))
			}
		}
		p.sweepMPS(ctx)
	}, staleInterval)
}

// sweepMPS deletes MPS daemons of this node whose claims it no longer holds
// (a checkpoint lost, or a daemon not stopped while the API was away).
func (p *Plugin) sweepMPS(ctx context.Context) {
	if p.mps == nil {
		return
	}
	held := p.driver.claims.PreparedClaims()
	keep := func(uid string) bool {
		c, ok := held[types.UID(uid)]
		return ok && c.MPS != nil
	}
	if err := p.mps.Sweep(ctx, keep); err != nil {
		klog.FromContext(ctx).Error(err, "Cannot sweep MPS daemons; retrying later")
	}
}
