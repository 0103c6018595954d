package cluster

import (
	"syscall"
	"testing"
)

// TestInotifyInstancesSeesThisProcesssOwn checks that the count of inotify
// instances a cluster start waits on includes one this process holds.
func TestInotifyInstancesSeesThisProcesssOwn(t *testing.T) {
	fd, err := syscall.InotifyInit()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = syscall.Close(fd) }()
	if n := inotifyInstances(); n < 1 {
		t.Errorf("%d inotify instances counted while this process holds one", n)
	}
	if _, err := inotifyLimit(); err != nil {
		t.Error(err)
	}
}

// TestInotifyNeededCountsEveryProcessOfTheCluster checks a two-node cluster
// with a real-runtime node: the control plane, two kubelets, one containerd.
func TestInotifyNeededCountsEveryProcessOfTheCluster(t *testing.T) {
	got := inotifyNeeded(Options{Nodes: []NodeSpec{{Name: "a"}, {Name: "b", Runtime: RealContainerd}}})
	if want := 6 + 2*6 + 2; got != want {
		t.Errorf("inotifyNeeded = %d, want %d", got, want)
	}
}
