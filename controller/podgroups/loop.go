package podgroups

import (
	"context"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
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
	// recorder, when set, records why an object is not placed (say);
	// said is what was last said of each key. Only the loop's one worker
	// uses them.
	recorder record.EventRecorder
	said     map[string]string
}

// ReasonNotPlaced is the reason of the events that say why a PodGroup or
// CompositePodGroup is not placed as a gang (yet).
const ReasonNotPlaced = "NotPlacedAsGang"

// say records why obj, of key, is not placed as a gang, as an event on it,
// when that changed since the last look; why "" (placed, or not Tessera's)
// forgets it. kubectl describe shows the user what the controller's log
// says.
func (l *loop) say(obj runtime.Object, key, why string) {
	switch {
	case l.said[key] == why:
	case why == "":
		delete(l.said, key)
	default:
		if l.said == nil {
			l.said = map[string]string{}
		}
		l.said[key] = why
		if l.recorder != nil {
			l.recorder.Event(obj, corev1.EventTypeNormal, ReasonNotPlaced, why)
		}
	}
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
