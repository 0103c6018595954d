package cluster

import (
	"bufio"
	"fmt"
	"os"
	"os/signal"
	"sort"
	"strings"
	"sync"
	"syscall"
)

var (
	liveMu sync.Mutex
	live   = map[*Cluster]struct{}{}
)

func register(c *Cluster) {
	liveMu.Lock()
	defer liveMu.Unlock()
	live[c] = struct{}{}
}

func unregister(c *Cluster) {
	liveMu.Lock()
	defer liveMu.Unlock()
	delete(live, c)
}

// StopOnInterrupt makes SIGINT and SIGTERM stop every running cluster before
// the process exits with status 130. Call it once from TestMain or a main
// function: `go test` ends a test binary on Ctrl-C without running
// t.Cleanup. (Components are also killed when the launcher dies outright,
// through Pdeathsig.)
func StopOnInterrupt() {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, os.Interrupt, syscall.SIGTERM)
	go func() {
		sig := <-ch
		fmt.Fprintf(os.Stderr, "cluster: %v: stopping local clusters\n", sig)
		liveMu.Lock()
		clusters := make([]*Cluster, 0, len(live))
		for c := range live {
			clusters = append(clusters, c)
		}
		liveMu.Unlock()
		for _, c := range clusters {
			c.Stop()
		}
		os.Exit(130)
	}()
}

// unmountBelow unmounts every mount point of this mount namespace below dir,
// deepest first. Kubelet mounts live in their own namespaces and vanish with
// them; this catches anything that leaked into the launcher's namespace.
func unmountBelow(dir string) error {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return fmt.Errorf("read mount table: %w", err)
	}
	defer func() { _ = f.Close() }()
	var points []string
	s := bufio.NewScanner(f)
	for s.Scan() {
		fields := strings.Fields(s.Text())
		if len(fields) > 4 && strings.HasPrefix(fields[4], dir+"/") {
			points = append(points, fields[4])
		}
	}
	if err := s.Err(); err != nil {
		return fmt.Errorf("read mount table: %w", err)
	}
	sort.Sort(sort.Reverse(sort.StringSlice(points)))
	var failed []string
	for _, p := range points {
		if err := syscall.Unmount(p, syscall.MNT_DETACH); err != nil {
			failed = append(failed, fmt.Sprintf("%s: %v", p, err))
		}
	}
	if len(failed) > 0 {
		return fmt.Errorf("unmount %s", strings.Join(failed, "; "))
	}
	return nil
}
