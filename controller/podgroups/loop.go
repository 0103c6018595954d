package podgroups

import (
	"context"
	"time"

	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"
)

// loop is one work queue of namespace/name keys of one kind of object and
// the function that syncs a key.
type loop struct {
	kind, api string
	queue     workqueue.TypedRateLimitingInterface[string]
	// sync syncs one key; again, when set, is when to look again.
	sync func(ctx context.Context, key string) (again time.Duration, _ error)
	// synced are the informer handlers the loop waits for before its first
	// sync.
	synced []cache.InformerSynced
}

func newLoop(name, kind, api string, sync func(context.Context, string) (time.Duration, error)) *loop {
	return &loop{
		kind: kind, api: api, sync: sync,
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(
			workqueue.NewTypedItemExponentialFailureRateLimiter[string](100*time.Millisecond, 30*time.Second),
			workqueue.TypedRateLimitingQueueConfig[string]{Name: name}),
	}
}

// enqueue adds the key of obj, an object of the loop's kind.
func (l *loop) enqueue(obj any) {
	if key, err := cache.MetaNamespaceKeyFunc(obj); err == nil {
		l.queue.Add(key)
	}
}

// work syncs the next key; false once the queue is shut down.
func (l *loop) work(ctx context.Context) bool {
	key, quit := l.queue.Get()
	if quit {
		return false
	}
	defer l.queue.Done(key)
	again, err := l.sync(ctx, key)
	if err != nil {
		klog.FromContext(ctx).Error(err, "Keeping the gang of a "+l.kind+" failed; retrying", "key", key)
		l.queue.AddRateLimited(key)
		return true
	}
	l.queue.Forget(key)
	if again > 0 {
		l.queue.AddAfter(key, again)
	}
	return true
}
