package controller

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	apiwatch "k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/klog/v2/ktesting"

	gangv1 "github.com/tessera-dev/tessera/api/gang/v1alpha1"
)

// TestTheDomainClassGoneStopsTheLeader: the controller publishes the domain
// pools under the UID of the domain DeviceClass. Changes to that class (a
// label) and to other classes leave it alone; deleting it stops the leader
// with a cause naming the class, and so does finding the class already
// replaced (another UID) when the watch starts.
func TestTheDomainClassGoneStopsTheLeader(t *testing.T) {
	class := func(name string, uid types.UID) *resourceapi.DeviceClass {
		return &resourceapi.DeviceClass{ObjectMeta: metav1.ObjectMeta{Name: name, UID: uid}}
	}
	// watch returns once the informer watches the classes. The fake
	// clientset, unlike an API server, does not replay a deletion made
	// between the informer's list and its watch: a change made before the
	// watch starts could be lost, and the test with it.
	watch := func(t *testing.T, client *fake.Clientset, uid types.UID) <-chan error {
		_, ctx := ktesting.NewTestContext(t)
		ctx, cancel := context.WithCancel(ctx)
		t.Cleanup(cancel)
		watching := make(chan struct{})
		var started sync.Once
		client.PrependWatchReactor("deviceclasses", func(action k8stesting.Action) (bool, apiwatch.Interface, error) {
			opts := action.(k8stesting.WatchActionImpl).ListOptions
			w, err := client.Tracker().Watch(action.GetResource(), action.GetNamespace(), opts)
			if err == nil {
				started.Do(func() { close(watching) })
			}
			return true, w, err
		})
		stops := make(chan error, 10)
		var once sync.Once
		if err := watchDomainClass(ctx, client, uid, func(err error) { once.Do(func() { stops <- err }) }); err != nil {
			t.Fatal(err)
		}
		select {
		case <-watching:
		case <-time.After(30 * time.Second):
			t.Fatal("the informer did not watch the DeviceClasses within 30 s")
		}
		return stops
	}
	wait := func(t *testing.T, stops <-chan error, want string) {
		t.Helper()
		select {
		case err := <-stops:
			if !errors.Is(err, errDomainClassReplaced) || !strings.Contains(err.Error(), gangv1.DomainClass) || !strings.Contains(err.Error(), want) {
				t.Fatalf("stopped with %v, want the class %s named and %q", err, gangv1.DomainClass, want)
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("not stopped within 30 s, want %q", want)
		}
	}

	t.Run("deleted", func(t *testing.T) {
		_, ctx := ktesting.NewTestContext(t)
		client := fake.NewClientset(class(gangv1.DomainClass, "uid-1"), class("gpu.tessera.dev", "uid-2"))
		stops := watch(t, client, "uid-1")
		classes := client.ResourceV1().DeviceClasses()
		c, _ := classes.Get(ctx, gangv1.DomainClass, metav1.GetOptions{})
		c.Labels = map[string]string{"changed": "true"}
		if _, err := classes.Update(ctx, c, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		if err := classes.Delete(ctx, "gpu.tessera.dev", metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		if err := classes.Delete(ctx, gangv1.DomainClass, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		// Events arrive in order: a stop for the label change or for the
		// other class would come first, and would not say "deleted".
		wait(t, stops, "was deleted")
	})
	t.Run("replaced before the watch started", func(t *testing.T) {
		stops := watch(t, fake.NewClientset(class(gangv1.DomainClass, "uid-new")), "uid-old")
		wait(t, stops, "replaced by uid uid-new")
	})
}
