package plugin

import (
	"context"
	"fmt"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"

	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/devicemeta"
	"github.com/tessera-dev/tessera/driver/prepare"
)

// staleInterval is how often prepared claims are checked against the API.
const staleInterval = time.Minute

// unprepareStale unprepares claims this node holds that the API server says
// are gone: deleted (or replaced under the same name) or no longer
// allocated, for example while the plugin was down and the kubelet forgot
// them. The API server is the source of truth; when it cannot be asked,
// nothing is unprepared. Runs at start and then every staleInterval.
//
// Nothing here holds a lock while the API server is asked (each request has
// its deadline, --kube-api-timeout): the prepared claims are read under the
// node lock, the API reads follow outside it, and each claim found stale is
// unprepared under its own lock only if its record is still the one read
// (prepare.Manager.UnprepareStale), so that prepares go on meanwhile.
func (p *Plugin) unprepareStale(ctx context.Context, client kubernetes.Interface) {
	wait.UntilWithContext(ctx, func(ctx context.Context) {
		p.sweepClaims(ctx, client)
		p.sweepDaemons(ctx)
	}, staleInterval)
}

// sweepClaims unprepares the claims the API server no longer has allocated.
func (p *Plugin) sweepClaims(ctx context.Context, client kubernetes.Interface) {
	logger := klog.FromContext(ctx)
	held, err := p.driver.claims.Snapshot(ctx)
	if err != nil {
		logger.Error(err, "Cannot check prepared claims against the API server")
		return
	}
	var unknown, unprepared int
	defer func() {
		logger.V(2).Info("Checked the prepared claims against the API server", "held", len(held), "unprepared", unprepared, "unknown", unknown)
	}()
	for uid, c := range held {
		claim, err := client.ResourceV1().ResourceClaims(c.Namespace).Get(ctx, c.Name, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
		case err != nil:
			unknown++
			logger.V(2).Info("Cannot check a prepared claim against the API server; keeping it", "claim", klog.KRef(c.Namespace, c.Name), "err", err)
			continue
		case claim.UID != uid || claim.Status.Allocation == nil:
		default:
			continue
		}
		done, err := p.driver.claims.UnprepareStale(ctx, uid, c)
		switch {
		case err != nil:
			logger.Error(err, "Unprepare of a stale claim failed; retrying later", "claim", klog.KRef(c.Namespace, c.Name))
		case done:
			unprepared++
			logger.Info("Unprepared a claim the API server no longer has allocated", "claim", klog.KRef(c.Namespace, c.Name), "uid", uid)
			if p.driver.lazy != nil {
				p.driver.lazy.heldChanged() // its GPU may be free now
			}
		default:
			logger.V(2).Info("A stale claim changed while the API server was asked; checking it again later", "claim", klog.KRef(c.Namespace, c.Name), "uid", uid)
		}
	}
}

// sweepDaemons deletes the MPS and IMEX daemons of this node whose claims
// it no longer holds (a checkpoint lost, or a daemon not stopped while the
// API was away). The daemons are listed before the claims are read, so that
// a daemon started after the read cannot be among them, and each is stopped
// under its claim's lock only if the claim still holds none
// (prepare.Manager.StopOrphanDaemon, StopOrphanIMEX).
func (p *Plugin) sweepDaemons(ctx context.Context) {
	type kind struct {
		name  string
		list  func(context.Context) ([]string, error)
		holds func(checkpoint.Claim) bool
		stop  func(context.Context, string) (bool, error)
	}
	var kinds []kind
	if p.mps != nil {
		kinds = append(kinds, kind{"MPS", p.mps.Claims, func(c checkpoint.Claim) bool { return c.MPS != nil }, p.driver.claims.StopOrphanDaemon})
	}
	if p.imex != nil {
		// Any record of a domain claim holds its daemon: an instance
		// of an earlier release sharing the checkpoint in a rolling
		// update rewrites records without the IMEX field.
		kinds = append(kinds, kind{"IMEX", p.imex.Claims, func(c checkpoint.Claim) bool { return c.IMEX != nil || c.Domain }, p.driver.claims.StopOrphanIMEX})
	}
	logger := klog.FromContext(ctx)
	for _, k := range kinds {
		daemons, err := k.list(ctx)
		if err != nil {
			logger.Error(err, "Cannot sweep daemons; retrying later", "daemon", k.name)
			continue
		}
		held, err := p.driver.claims.Snapshot(ctx)
		if err != nil {
			logger.Error(err, "Cannot sweep daemons; retrying later", "daemon", k.name)
			continue
		}
		for _, uid := range daemons {
			if c, ok := held[types.UID(uid)]; ok && k.holds(c) {
				continue
			}
			if _, err := k.stop(ctx, uid); err != nil {
				logger.Error(err, "Cannot sweep daemons; retrying later", "daemon", k.name)
			}
		}
	}
}

// sweepMetadata removes the device metadata of claims the node does not
// hold (driver/devicemeta). It runs before the plugin registers with the
// kubelet, so no prepare writes meanwhile; beside another instance
// (rolling), which prepares all along, it leaves everything: the next
// start on its own sweeps.
func sweepMetadata(ctx context.Context, meta *devicemeta.Files, mgr *prepare.Manager, rolling bool) error {
	if meta == nil || rolling {
		return nil
	}
	var held []devicemeta.Claim
	for uid, c := range mgr.PreparedClaims() {
		held = append(held, devicemeta.Claim{Namespace: c.Namespace, Name: c.Name, UID: uid})
	}
	n, err := meta.Sweep(held)
	if err != nil {
		return fmt.Errorf("remove the device metadata of claims no longer prepared: %w", err)
	}
	if n > 0 {
		klog.FromContext(ctx).Info("Removed the device metadata of claims no longer prepared", "files", n)
	}
	return nil
}
