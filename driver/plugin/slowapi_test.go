package plugin_test

import (
	"context"
	"sync"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	corev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	resourcev1 "k8s.io/client-go/kubernetes/typed/resource/v1"
)

// stall holds up the reads of one object until the test lets them through.
// (A fake clientset's reactor cannot: it runs under the clientset's lock,
// stalling every call.)
type stall struct {
	name    string
	asked   chan struct{} // closed at the first read
	answer  chan struct{} // closed to let the reads through
	askOnce sync.Once
	relOnce sync.Once
}

func newStall(name string) *stall {
	return &stall{name: name, asked: make(chan struct{}), answer: make(chan struct{})}
}

// wait holds up a read of name until release.
func (s *stall) wait(ctx context.Context, name string) {
	if name != s.name {
		return
	}
	s.askOnce.Do(func() { close(s.asked) })
	select {
	case <-s.answer:
	case <-ctx.Done():
	}
}

func (s *stall) release() { s.relOnce.Do(func() { close(s.answer) }) }

// stalledClaims is an API client whose reads of the named ResourceClaim
// stall.
type stalledClaims struct {
	kubernetes.Interface
	s *stall
}

func (c stalledClaims) ResourceV1() resourcev1.ResourceV1Interface {
	return stalledResource{c.Interface.ResourceV1(), c.s}
}

type stalledResource struct {
	resourcev1.ResourceV1Interface
	s *stall
}

func (r stalledResource) ResourceClaims(ns string) resourcev1.ResourceClaimInterface {
	return stalledClaimReads{r.ResourceV1Interface.ResourceClaims(ns), r.s}
}

type stalledClaimReads struct {
	resourcev1.ResourceClaimInterface
	s *stall
}

func (c stalledClaimReads) Get(ctx context.Context, name string, o metav1.GetOptions) (*resourceapi.ResourceClaim, error) {
	c.s.wait(ctx, name)
	return c.ResourceClaimInterface.Get(ctx, name, o)
}

// stalledPods is an API client whose reads of the named pod stall, then
// find it running.
type stalledPods struct {
	kubernetes.Interface
	s *stall
}

func (c stalledPods) CoreV1() corev1.CoreV1Interface { return stalledCore{c.Interface.CoreV1(), c.s} }

type stalledCore struct {
	corev1.CoreV1Interface
	s *stall
}

func (c stalledCore) Pods(ns string) corev1.PodInterface {
	return stalledPodReads{c.CoreV1Interface.Pods(ns), c.s}
}

type stalledPodReads struct {
	corev1.PodInterface
	s *stall
}

func (p stalledPodReads) Get(ctx context.Context, name string, o metav1.GetOptions) (*v1.Pod, error) {
	p.s.wait(ctx, name)
	pod, err := p.PodInterface.Get(ctx, name, o)
	if err == nil && name == p.s.name {
		pod.Status.Phase = v1.PodRunning
		pod.Status.ContainerStatuses = []v1.ContainerStatus{{Name: "mps-control-daemon", State: v1.ContainerState{Running: &v1.ContainerStateRunning{}}}}
	}
	return pod, err
}

// The fake clientset serves no watch-list; informers must be told so
// through the wrapper too.
func (c stalledClaims) IsWatchListSemanticsUnSupported() bool { return true }
func (c stalledPods) IsWatchListSemanticsUnSupported() bool   { return true }
