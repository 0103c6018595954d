package e2e

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
)

// simNodeName names the i-th simulated node.
func simNodeName(i int) string { return fmt.Sprintf("sim-%d", i) }

// simulateNodes creates one Ready node without a kubelet per entry of
// published, named simNodeName(i), publishes that entry's slices for it
// through the API, and keeps the nodes' Leases fresh so that the
// node-lifecycle controller leaves them Ready, until the returned stop. It
// returns once every node is schedulable (the not-ready taint the apiserver
// puts on new nodes is gone).
func simulateNodes(ctx context.Context, b testing.TB, client kubernetes.Interface, published [][]*resourceapi.ResourceSlice) (stop func()) {
	b.Helper()
	n := len(published)
	api := client.CoordinationV1().Leases(corev1.NamespaceNodeLease)
	// Leases are renewed from the start: creating hundreds of nodes takes
	// longer than the node-lifecycle controller's grace period, and a node
	// it marks unreachable stays so (nothing posts its status again).
	var mu sync.Mutex
	leases := make([]*coordinationv1.Lease, n) // set once a node's Lease exists
	renewOne := func(i int) {
		mu.Lock()
		l := leases[i]
		mu.Unlock()
		if l == nil {
			return
		}
		l = l.DeepCopy()
		now := metav1.NewMicroTime(time.Now())
		l.Spec.RenewTime = &now
		// Only the renewers write the Lease once created, each Lease by one
		// renewer a round: keep what the update returned, read it again
		// only after a failure.
		updated, err := api.Update(ctx, l, metav1.UpdateOptions{})
		if err != nil {
			updated, err = api.Get(ctx, l.Name, metav1.GetOptions{})
		}
		if err == nil {
			mu.Lock()
			leases[i] = updated
			mu.Unlock()
		}
	}
	// Renewed by several clients at once: one at a time, a thousand Leases
	// took longer than their 40 s on a busy apiserver (1,000 dynamic-MIG
	// nodes publishing), and the node-lifecycle controller tainted them.
	renew := func() { eachIndex(n, 8, renewOne) }
	done := make(chan struct{})
	var renewing sync.WaitGroup
	renewing.Go(func() {
		t := time.NewTicker(10 * time.Second)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-ctx.Done():
				return
			case <-t.C:
				renew()
			}
		}
	})
	stop = func() { close(done); renewing.Wait() }

	// Nodes are created in parallel: a sequential loop takes minutes for
	// hundreds of nodes of several slices each.
	errs := make([]error, n)
	eachIndex(n, 8, func(i int) {
		errs[i] = createSimNode(ctx, client, simNodeName(i), published[i], func(l *coordinationv1.Lease) {
			mu.Lock()
			leases[i] = l
			mu.Unlock()
		})
	})
	if err := errors.Join(errs...); err != nil {
		stop()
		b.Fatal(err)
	}
	if err := waitSchedulable(ctx, client, n); err != nil {
		stop()
		b.Fatal(err)
	}
	return stop
}

// eachIndex calls do for 0..n-1 from workers goroutines, as that many
// clients would, and returns when every call has.
func eachIndex(n, workers int, do func(i int)) {
	next := make(chan int)
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for i := range next {
				do(i)
			}
		})
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
}

// createSimNode creates a node and its Lease (passed to leased), makes the
// node Ready and publishes its slices.
func createSimNode(ctx context.Context, client kubernetes.Interface, name string, slices []*resourceapi.ResourceSlice, leased func(*coordinationv1.Lease)) error {
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"kubernetes.io/hostname": name}}}
	if _, err := client.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("create node %s: %w", name, err)
	}
	now := metav1.NewMicroTime(time.Now())
	lease, err := client.CoordinationV1().Leases(corev1.NamespaceNodeLease).Create(ctx, &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: coordinationv1.LeaseSpec{HolderIdentity: ptr.To(name), LeaseDurationSeconds: ptr.To[int32](40), RenewTime: &now}}, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("create the Lease of node %s: %w", name, err)
	}
	leased(lease)
	// The node-lifecycle controller writes the new node too: retry.
	err = retry.RetryOnConflict(retry.DefaultRetry, func() error {
		n, err := client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		list := corev1.ResourceList{corev1.ResourcePods: resource.MustParse("110"), corev1.ResourceCPU: resource.MustParse("128"), corev1.ResourceMemory: resource.MustParse("1Ti")}
		n.Status.Capacity, n.Status.Allocatable = list, list
		n.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "Simulated", LastHeartbeatTime: metav1.Now(), LastTransitionTime: metav1.Now()}}
		_, err = client.CoreV1().Nodes().UpdateStatus(ctx, n, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		return fmt.Errorf("make node %s Ready: %w", name, err)
	}
	for i, s := range slices {
		s = s.DeepCopy()
		// Named as kubeletplugin's slice controller names them: the
		// index first (hex, five digits), then the driver and the owner
		// (the node). The allocator meets a pool's slices in name order,
		// so random names would shuffle the order the plugin chose.
		s.Name = ""
		s.GenerateName = fmt.Sprintf("%05x-%s-%s-", i, s.Spec.Driver, name)
		if _, err := client.ResourceV1().ResourceSlices().Create(ctx, s, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("publish slices of %s: %w", name, err)
		}
	}
	return nil
}

// waitSchedulable waits until n nodes exist and none has a taint.
func waitSchedulable(ctx context.Context, client kubernetes.Interface, n int) error {
	var tainted, seen int
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		list, err := client.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		seen, tainted = len(list.Items), 0
		for _, node := range list.Items {
			if len(node.Spec.Taints) > 0 {
				tainted++
			}
		}
		return seen == n && tainted == 0, nil
	})
	if err != nil {
		return fmt.Errorf("simulated nodes not schedulable: %d of %d exist, %d tainted: %w", seen, n, tainted, err)
	}
	return nil
}
