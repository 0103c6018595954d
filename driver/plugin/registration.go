package plugin

import (
	"context"
	"errors"
	"sync"
	"time"

	"google.golang.org/grpc"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
	"k8s.io/utils/clock"
)

// DefaultRegistrationWait bounds how long the first publish waits for the
// kubelet to register the plugin. The kubelet's plugin watcher registers a
// new socket within about a second.
const DefaultRegistrationWait = 5 * time.Second

// registration tells when the kubelet has registered this plugin instance.
//
// The node's devices are published only after that (or after
// Options.RegistrationWait, to publish on a kubelet that never registers
// us as well): the scheduler sends pods to a node as soon as its slices
// are there, and a pod whose kubelet does not know the driver yet fails
// its prepare and is retried only a minute later (the kubelet's pod
// backoff).
type registration struct {
	once sync.Once
	done chan struct{}
}

func newRegistration() *registration { return &registration{done: make(chan struct{})} }

// interceptor watches the kubelet's calls on the registration socket: a
// NotifyRegistrationStatus saying the plugin is registered, served without
// error, marks it registered.
func (r *registration) interceptor(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	resp, err := handler(ctx, req)
	if err == nil && info.FullMethod == registerapi.Registration_NotifyRegistrationStatus_FullMethodName {
		if s, ok := req.(*registerapi.RegistrationStatus); ok && s.PluginRegistered {
			r.once.Do(func() { close(r.done) })
		}
	}
	return resp, err
}

// ready is the plugin's readiness (/readyz): registered with the kubelet.
// The chart's readiness probe makes a rolling update wait for it before
// the old plugin pod goes.
func (r *registration) ready() error {
	select {
	case <-r.done:
		return nil
	default:
		return errors.New("not registered with the kubelet yet")
	}
}

// wait returns true once the plugin is registered, false when ctx ends or
// max passes first.
func (r *registration) wait(ctx context.Context, clk clock.Clock, max time.Duration) bool {
	timer := clk.NewTimer(max)
	defer timer.Stop()
	select {
	case <-r.done:
		return true
	case <-ctx.Done():
	case <-timer.C():
	}
	return false
}
