// Package controller runs tessera-controller (a Deployment): while it holds
// the leader Lease it publishes the gang domains (package domains) and
// places gangs (package gang).
package controller

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
	"github.com/tessera-dev/tessera/component"
	"github.com/tessera-dev/tessera/controller/domains"
	"github.com/tessera-dev/tessera/controller/gang"
	"github.com/tessera-dev/tessera/controller/nodelabels"
	"github.com/tessera-dev/tessera/controller/podgroups"
	"github.com/tessera-dev/tessera/driver/slices"
	"github.com/tessera-dev/tessera/metricsserver"
)

// resync is how often every gang is looked at again without an event.
const resync = 30 * time.Second

// Run runs the controller until ctx ends; with leader election, only while
// it leads. It returns an error when it cannot start or loses the lead.
func Run(ctx context.Context, o Options) error {
	logger := klog.FromContext(ctx)
	cfg, err := o.restConfig()
	if err != nil {
		return err
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return err
	}
	reg := prometheus.NewRegistry()
	metrics, err := gang.NewMetrics(reg)
	if err != nil {
		return err
	}
	srv, err := metricsserver.Start(ctx, o.Addresses, reg, func() error { return context.Cause(ctx) })
	if err != nil {
		return err
	}
	defer srv.Stop()
	lead := func(ctx context.Context) error {
		return runLeading(ctx, o, client, dyn, metrics)
	}
	if !o.LeaderElect {
		return lead(ctx)
	}
	host, _ := os.Hostname()
	id := host + "_" + uuid.NewString()
	lock := &resourcelock.LeaseLock{
		LeaseMeta:  metav1.ObjectMeta{Namespace: o.LeaseNamespace, Name: o.LeaseName},
		Client:     client.CoordinationV1(),
		LockConfig: resourcelock.ResourceLockConfig{Identity: id},
	}
	ctx, cancel := context.WithCancel(ctx)
	var started atomic.Bool
	led := make(chan error, 1)
	defer cancel()
	le, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
		Lock:            lock,
		LeaseDuration:   o.LeaseDuration,
		RenewDeadline:   o.RenewDeadline,
		RetryPeriod:     o.RetryPeriod,
		ReleaseOnCancel: true,
		Name:            o.LeaseName,
		Callbacks: leaderelection.LeaderCallbacks{
			OnStartedLeading: func(ctx context.Context) {
				logger.Info("Leading", "identity", id)
				started.Store(true)
				led <- lead(ctx)
				cancel()
			},
			OnStoppedLeading: func() {
				logger.Info("No longer leading", "identity", id)
			},
		},
	})
	if err != nil {
		return fmt.Errorf("leader election: %w", err)
	}
	le.Run(ctx)
	if started.Load() {
		if err := <-led; err != nil {
			return err
		}
	}
	if ctx.Err() == nil || errors.Is(context.Cause(ctx), context.Canceled) {
		return nil
	}
	return fmt.Errorf("lost the leader Lease %s/%s", o.LeaseNamespace, o.LeaseName)
}

// restConfig is the configuration of every API client of the controller:
// the typed and dynamic clients, discovery, informers and leader election.
func (o Options) restConfig() (*rest.Config, error) {
	return component.RESTConfig(o.Kubeconfig, o.KubeAPIQPS, o.KubeAPIBurst, "tessera-controller", o.apiTimeout())
}

// domainClassOwner waits until Tessera's domain DeviceClass exists and
// returns it as the owner of the domain pools' slices. Helm creates
// DeviceClasses after Deployments, so a fresh install's controller may
// start first.
func domainClassOwner(ctx context.Context, client kubernetes.Interface) (*resourceslice.Owner, error) {
	logger := klog.FromContext(ctx)
	var owner *resourceslice.Owner
	waited := false
	err := wait.PollUntilContextCancel(ctx, 2*time.Second, true, func(ctx context.Context) (bool, error) {
		list, err := client.ResourceV1().DeviceClasses().List(ctx, metav1.ListOptions{FieldSelector: "metadata.name=" + gangv1.DomainClass})
		switch {
		case err != nil:
			logger.Error(err, "Listing the domain DeviceClass failed; retrying", "deviceClass", gangv1.DomainClass)
			return false, nil
		case len(list.Items) == 0:
			// Said once: until the class exists no domain is published and
			// no gang placed.
			if !waited {
				logger.Info("Waiting for the domain DeviceClass, which owns the domain pools; no gang is placed until it exists (install Tessera's DeviceClasses)", "deviceClass", gangv1.DomainClass)
			}
			waited = true
			return false, nil
		}
		if waited {
			logger.Info("The domain DeviceClass exists", "deviceClass", gangv1.DomainClass)
		}
		c := list.Items[0]
		owner = &resourceslice.Owner{APIVersion: "resource.k8s.io/v1", Kind: "DeviceClass", Name: c.Name, UID: c.UID}
		return true, nil
	})
	if err != nil {
		return nil, fmt.Errorf("wait for DeviceClass %s: %w", gangv1.DomainClass, err)
	}
	return owner, nil
}

// runLeading publishes the domains and places gangs until ctx ends or the
// gang controller stops on its own.
func runLeading(ctx context.Context, o Options, client kubernetes.Interface, dyn dynamic.Interface, metrics *gang.Metrics) error {
	ctx, cancelCause := context.WithCancelCause(ctx)
	cancel := func() { cancelCause(context.Canceled) }
	factory := informers.NewSharedInformerFactory(client, 0)
	dynFactory := dynamicinformer.NewDynamicSharedInformerFactory(dyn, 0)
	// Shutdown waits for the informers, which stop with ctx: cancel first
	// (deferred calls run last-in, first-out).
	defer factory.Shutdown()
	defer dynFactory.Shutdown()
	defer cancel()
	owner, err := domainClassOwner(ctx, client)
	if err != nil {
		return err
	}
	if err := watchDomainClass(ctx, client, owner.UID, cancelCause); err != nil {
		return err
	}
	if _, err := domains.Start(ctx, client, factory, domains.Options{Driver: slices.DriverName, TopologyKey: o.TopologyKey, Channels: o.Channels, Owner: owner}); err != nil {
		return err
	}
	if o.NodeLabels {
		if err := nodelabels.Start(ctx, client, factory, nodelabels.Options{Driver: slices.DriverName}); err != nil {
			return err
		}
	}
	gc, err := gang.New(ctx, client, dyn, factory, dynFactory, gang.Options{
		Driver: slices.DriverName, Resync: resync, Metrics: metrics, Interrupt: o.Interrupt,
		UnschedulableGrace: o.UnschedulableGrace, IMEXDaemons: o.IMEXDaemons, DaemonNamespace: o.DaemonNamespace,
		NoReservations: o.NoReservations,
	})
	if err != nil {
		return err
	}
	served, err := podgroups.Served(client.Discovery())
	switch {
	case err != nil:
		return err
	case served:
		composites, err := podgroups.CompositeServed(client.Discovery())
		if err != nil {
			return err
		}
		if !composites {
			klog.FromContext(ctx).Info("The API server does not serve CompositePodGroups; their child PodGroups are placed alone", "api", podgroups.CompositeGroupVersion)
		}
		if err := podgroups.Start(ctx, client, dyn, factory, composites); err != nil {
			return err
		}
	default:
		klog.FromContext(ctx).Info("The API server does not serve PodGroups; gangs are declared with Gang objects only", "api", podgroups.GroupVersion)
	}
	factory.Start(ctx.Done())
	dynFactory.Start(ctx.Done())
	err = gc.Run(ctx)
	if cause := context.Cause(ctx); errors.Is(cause, errDomainClassReplaced) {
		return cause
	}
	return err
}

// errDomainClassReplaced ends the controller's leading when the DeviceClass
// that owns the domain pools is deleted or replaced.
var errDomainClassReplaced = errors.New("the domain DeviceClass was deleted or replaced")

// watchDomainClass calls stop once the domain DeviceClass with UID uid is
// deleted or replaced by another of the same name. The domain pools'
// slices name that UID as their owner: the garbage collector deletes them
// with it, and slices published again under the stale UID would be deleted
// again, over and over. The controller then exits, and its restart
// publishes the pools under the class as it is then.
func watchDomainClass(ctx context.Context, client kubernetes.Interface, uid types.UID, stop context.CancelCauseFunc) error {
	factory := informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithTweakListOptions(func(o *metav1.ListOptions) {
		o.FieldSelector = "metadata.name=" + gangv1.DomainClass
	}))
	check := func(obj any, deleted bool) {
		if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
			obj, deleted = d.Obj, true
		}
		c, ok := obj.(*resourceapi.DeviceClass)
		if !ok || c.Name != gangv1.DomainClass || (!deleted && c.UID == uid) {
			return
		}
		what := "deleted"
		if !deleted {
			what = "replaced by uid " + string(c.UID)
		}
		klog.FromContext(ctx).Info("The domain DeviceClass that owns the domain pools is gone; stopping to publish them under the class as it is now",
			"deviceClass", gangv1.DomainClass, "uid", uid, "change", what)
		stop(fmt.Errorf("%w: %s (uid %s) was %s; the controller restarts to publish the domain pools under the class as it is now", errDomainClassReplaced, gangv1.DomainClass, uid, what))
	}
	informer := factory.Resource().V1().DeviceClasses().Informer()
	if _, err := informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { check(obj, false) },
		UpdateFunc: func(_, obj any) { check(obj, false) },
		DeleteFunc: func(obj any) { check(obj, true) },
	}); err != nil {
		return fmt.Errorf("watch DeviceClass %s: %w", gangv1.DomainClass, err)
	}
	factory.Start(ctx.Done())
	go func() {
		// A class deleted before the watch's first list never shows up.
		if cache.WaitForCacheSync(ctx.Done(), informer.HasSynced) {
			if _, exists, _ := informer.GetStore().GetByKey(gangv1.DomainClass); !exists {
				check(&resourceapi.DeviceClass{ObjectMeta: metav1.ObjectMeta{Name: gangv1.DomainClass}}, true)
			}
		}
		<-ctx.Done()
		factory.Shutdown()
	}()
	return nil
}
