package cluster

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"k8s.io/klog/v2"
)

// A cluster's processes hold inotify instances, which the kernel bounds per
// user (fs.inotify.max_user_instances, 128 by default): each kubelet holds
// six, the control plane six (API server three, scheduler two, controller
// manager one), each real-runtime node's containerd two. A kubelet that
// finds none free exits at start ("Failed to start cAdvisor: inotify_init:
// too many open files"), so a cluster starts only once the machine has
// room for all of its instances (waitForInotify): with tests running side
// by side, two five-node clusters and a few small ones already hold about
// a hundred.
const (
	inotifyPerKubelet      = 6
	inotifyPerControlPlane = 6
	inotifyPerContainerd   = 2
	// inotifyWait is how long a start waits for room before it fails.
	inotifyWait = 10 * time.Minute
)

// inotifyNeeded is how many inotify instances a cluster of opts holds.
func inotifyNeeded(opts Options) int {
	n := inotifyPerControlPlane
	for _, node := range opts.Nodes {
		n += inotifyPerKubelet
		if node.Runtime == RealContainerd {
			n += inotifyPerContainerd
		}
	}
	return n
}

// waitForInotify waits until this machine's processes hold few enough
// inotify instances that need more fit under the limit.
func waitForInotify(ctx context.Context, need int) error {
	limit, err := inotifyLimit()
	if err != nil {
		return err
	}
	if need > limit {
		return fmt.Errorf("the cluster needs %d inotify instances, more than fs.inotify.max_user_instances (%d) allows: raise it (sysctl fs.inotify.max_user_instances=512)", need, limit)
	}
	ctx, cancel := context.WithTimeout(ctx, inotifyWait)
	defer cancel()
	start := time.Now()
	logged := false
	for {
		used := inotifyInstances()
		if used+need <= limit {
			if logged {
				klog.FromContext(ctx).Info("Room for the cluster's inotify instances", "need", need, "used", used, "limit", limit, "waited", time.Since(start).Round(time.Second))
			}
			return nil
		}
		if !logged {
			klog.FromContext(ctx).Info("Waiting for other clusters to free inotify instances", "need", need, "used", used, "limit", limit)
			logged = true
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("no room for the cluster's %d inotify instances within %v: this machine's processes hold %d of fs.inotify.max_user_instances=%d (raise it: sysctl fs.inotify.max_user_instances=512): %w",
				need, inotifyWait, used, limit, context.Cause(ctx))
		case <-time.After(time.Second):
		}
	}
}

// inotifyLimit reads fs.inotify.max_user_instances.
func inotifyLimit() (int, error) {
	data, err := os.ReadFile("/proc/sys/fs/inotify/max_user_instances")
	if err != nil {
		return 0, fmt.Errorf("read the inotify instance limit: %w", err)
	}
	limit, err := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil {
		return 0, fmt.Errorf("parse the inotify instance limit %q: %w", data, err)
	}
	return limit, nil
}

// inotifyInstances counts the inotify instances this user's processes
// hold (their file descriptors of anon_inode:inotify).
func inotifyInstances() int {
	fds, _ := filepath.Glob("/proc/[0-9]*/fd/*")
	uid := os.Geteuid()
	owners := map[string]bool{} // /proc/<pid> -> of this user
	n := 0
	for _, fd := range fds {
		if target, err := os.Readlink(fd); err != nil || target != "anon_inode:inotify" {
			continue
		}
		proc := filepath.Dir(filepath.Dir(fd))
		mine, ok := owners[proc]
		if !ok {
			mine = ownedBy(proc, uid)
			owners[proc] = mine
		}
		if mine {
			n++
		}
	}
	return n
}

// ownedBy reports whether the process at proc (/proc/<pid>) runs as uid.
func ownedBy(proc string, uid int) bool {
	data, err := os.ReadFile(filepath.Join(proc, "status"))
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(data), "\n") {
		if rest, ok := strings.CutPrefix(line, "Uid:"); ok {
			f := strings.Fields(rest)
			return len(f) > 1 && f[1] == strconv.Itoa(uid) // the effective uid
		}
	}
	return false
}
