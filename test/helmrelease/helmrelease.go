// Package helmrelease installs, upgrades and uninstalls Tessera's chart
// (deployments/helm/tessera) with Helm itself: the helm command built from
// helm.sh/helm/v4 at the version go.mod pins (a tool of this module, `go
// tool helm`), run as an operator runs it. It runs the command rather than
// calling Helm's action package in process: that package links Go's plugin
// package (through kustomize), which makes the linker bind every symbol at
// start, and then a test binary that also links go-nvml's lazily resolved
// NVML symbols cannot start.
package helmrelease

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"time"
)

// Timeout bounds each Helm operation (helm --timeout).
const Timeout = 2 * time.Minute

// Client runs helm for releases in one namespace of the cluster a
// kubeconfig file names.
type Client struct {
	helm, chart, kubeconfig, namespace, dir string
}

// New builds the helm command from the module in moduleDir into workDir
// (Go's build cache makes later builds quick) and returns a client for
// releases of the module's chart in namespace.
func New(ctx context.Context, moduleDir, workDir, kubeconfig, namespace string) (*Client, error) {
	if err := os.MkdirAll(workDir, 0o755); err != nil {
		return nil, err
	}
	helm := filepath.Join(workDir, "helm")
	build := exec.CommandContext(ctx, "go", "build", "-o", helm, "helm.sh/helm/v4/cmd/helm")
	build.Dir = moduleDir
	if out, err := build.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("build helm (go build helm.sh/helm/v4/cmd/helm): %w\n%s", err, out)
	}
	chart, err := filepath.Abs(filepath.Join(moduleDir, "deployments", "helm", "tessera"))
	if err != nil {
		return nil, err
	}
	return &Client{helm: helm, chart: chart, kubeconfig: kubeconfig, namespace: namespace, dir: workDir}, nil
}

// Install runs `helm install name <chart> --create-namespace` with values.
// It does not wait for the workloads to become ready (Helm's default):
// callers check what they need.
func (c *Client) Install(ctx context.Context, name string, values map[string]any) error {
	return c.withValues(ctx, values, "install", name, c.chart, "--create-namespace")
}

// Upgrade runs `helm upgrade name <chart>` with values replacing the
// release's.
func (c *Client) Upgrade(ctx context.Context, name string, values map[string]any) error {
	return c.withValues(ctx, values, "upgrade", name, c.chart)
}

// Uninstall runs `helm uninstall name --wait`: it returns once the
// release's objects are gone.
func (c *Client) Uninstall(ctx context.Context, name string) error {
	return c.run(ctx, "uninstall", name, "--wait")
}

// withValues runs helm with args and values in a values file.
func (c *Client) withValues(ctx context.Context, values map[string]any, args ...string) error {
	data, err := json.Marshal(values) // JSON is YAML
	if err != nil {
		return fmt.Errorf("encode the chart's values: %w", err)
	}
	f, err := os.CreateTemp(c.dir, "values-*.json")
	if err != nil {
		return err
	}
	defer func() { _ = os.Remove(f.Name()) }()
	if _, err := f.Write(data); err != nil {
		_ = f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return c.run(ctx, append(args, "--values", f.Name())...)
}

// run runs helm with args for the client's cluster and namespace.
func (c *Client) run(ctx context.Context, args ...string) error {
	args = append(args, "--namespace", c.namespace, "--kubeconfig", c.kubeconfig, "--timeout", Timeout.String())
	cmd := exec.CommandContext(ctx, c.helm, args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	// Helm keeps its caches and configuration below these: not the user's.
	cmd.Env = append(os.Environ(), "HELM_CACHE_HOME="+filepath.Join(c.dir, "cache"),
		"HELM_CONFIG_HOME="+filepath.Join(c.dir, "config"), "HELM_DATA_HOME="+filepath.Join(c.dir, "data"))
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("helm %v: %w\n%s", args, err, out.String())
	}
	return nil
}
