package cluster

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"

	"k8s.io/klog/v2"
)

// process is one cluster component running as its own process group, with
// stdout and stderr appended to a log file.
type process struct {
	name    string
	logPath string
	cmd     *exec.Cmd
	done    chan struct{}
	waitErr error // valid once done is closed
}

// startProcess starts argv in a new process group, in the working directory
// workDir (created if missing). The process is killed when the launcher dies
// (Pdeathsig), so an interrupted test leaves nothing running.
//
// Each component gets a working directory of its own because the kubelet
// removes files relative to its working directory when a runtime reports a
// container without a log path (it globs "<logPath>*"); it must never run in
// the launcher's directory.
func startProcess(ctx context.Context, name, workDir, logPath string, argv []string) (*process, error) {
	if err := os.MkdirAll(workDir, 0o750); err != nil {
		return nil, fmt.Errorf("create working directory of %s: %w", name, err)
	}
	logFile, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open log of %s: %w", name, err)
	}
	fmt.Fprintf(logFile, "\n==== %s: %s\n", time.Now().Format(time.RFC3339), strings.Join(argv, " "))
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Dir = workDir
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		_ = logFile.Close()
		return nil, fmt.Errorf("start %s (%s): %w", name, argv[0], err)
	}
	p := &process{name: name, logPath: logPath, cmd: cmd, done: make(chan struct{})}
	go func() {
		p.waitErr = cmd.Wait()
		_ = logFile.Close()
		close(p.done)
	}()
	klog.FromContext(ctx).V(2).Info("Started", "component", name, "pid", cmd.Process.Pid, "log", logPath)
	return p, nil
}

// exited reports whether the process has ended, and how.
func (p *process) exited() (bool, error) {
	select {
	case <-p.done:
		return true, p.waitErr
	default:
		return false, nil
	}
}

// stop sends SIGTERM to the process group, then SIGKILL after grace.
func (p *process) stop(grace time.Duration) {
	if p == nil {
		return
	}
	pgid := p.cmd.Process.Pid
	_ = syscall.Kill(-pgid, syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(grace):
	}
	// Children of the leader may outlive it; the group is killed either way.
	_ = syscall.Kill(-pgid, syscall.SIGKILL)
	<-p.done
}

// waitFor polls check until it succeeds, the process dies or timeout passes.
func (p *process) waitFor(ctx context.Context, what string, timeout time.Duration, check func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	start := time.Now()
	var last error
	for {
		if done, err := p.exited(); done {
			return fmt.Errorf("%s exited while waiting for %s (%v); last log lines of %s:\n%s",
				p.name, what, err, p.logPath, tail(p.logPath, 20))
		}
		if last = check(ctx); last == nil {
			klog.FromContext(ctx).V(2).Info("Ready", "component", p.name, "condition", what, "after", time.Since(start).Round(time.Millisecond))
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s: %s not reached within %v (last error: %w); last log lines of %s:\n%s",
				p.name, what, timeout, last, p.logPath, tail(p.logPath, 20))
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// tail returns the last n lines of a file, or why it cannot.
func tail(path string, n int) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(cannot read %s: %v)", path, err)
	}
	data = bytes.TrimRight(data, "\n")
	lines := bytes.Split(data, []byte("\n"))
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return string(bytes.Join(lines, []byte("\n")))
}
