package cluster

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// SchedulerLog is the path of kube-scheduler's log.
func (c *Cluster) SchedulerLog() string { return c.logPath("kube-scheduler") }

// clockTicks is the kernel's USER_HZ, the unit of /proc/<pid>/stat times: 100
// on every Linux architecture Go runs on.
const clockTicks = 100

// SchedulerCPU is the CPU time (user and system) kube-scheduler has used so
// far, read from /proc/<pid>/stat.
func (c *Cluster) SchedulerCPU() (time.Duration, error) {
	if c.scheduler == nil {
		return 0, fmt.Errorf("the cluster has no scheduler")
	}
	return processCPU(c.scheduler.cmd.Process.Pid)
}

// processCPU reads a process's utime and stime from /proc/<pid>/stat.
func processCPU(pid int) (time.Duration, error) {
	data, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return 0, fmt.Errorf("read CPU time of process %d: %w", pid, err)
	}
	// The command name (field 2) is in parentheses and may hold spaces:
	// count fields after its closing one. utime and stime are fields 14
	// and 15, so the 12th and 13th after it.
	_, rest, ok := strings.Cut(string(data), ") ")
	if !ok {
		return 0, fmt.Errorf("process %d: unexpected /proc stat %q", pid, data)
	}
	fields := strings.Fields(rest)
	if len(fields) < 13 {
		return 0, fmt.Errorf("process %d: unexpected /proc stat %q", pid, data)
	}
	var ticks int64
	for _, f := range fields[11:13] {
		n, err := strconv.ParseInt(f, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("process %d: CPU time %q: %w", pid, f, err)
		}
		ticks += n
	}
	return time.Duration(ticks) * time.Second / clockTicks, nil
}

// SchedulerGet fetches a path (for example /metrics or
// /debug/pprof/profile?seconds=10) from kube-scheduler's secure port as the
// cluster's admin, and returns the body.
func (c *Cluster) SchedulerGet(ctx context.Context, path string) ([]byte, error) {
	if c.scheduler == nil {
		return nil, fmt.Errorf("the cluster has no scheduler")
	}
	cert, err := tls.LoadX509KeyPair(filepath.Join(c.pkiDir(), "admin-client.crt"), filepath.Join(c.pkiDir(), "admin-client.key"))
	if err != nil {
		return nil, fmt.Errorf("load admin client certificate: %w", err)
	}
	client := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{
		Certificates: []tls.Certificate{cert},
		// The scheduler serves a self-signed certificate on loopback.
		InsecureSkipVerify: true, //nolint:gosec // loopback, the scheduler's self-signed certificate
	}}}
	url := fmt.Sprintf("https://127.0.0.1:%d%s", c.schedPort, path)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("GET %s: %w", url, err)
	}
	defer func() { _ = resp.Body.Close() }()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("GET %s: %w", url, err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %s: %s", url, resp.Status, body)
	}
	return body, nil
}
