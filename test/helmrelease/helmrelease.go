// Package helmrelease installs, upgrades and uninstalls Tessera's chart
// (deployments/helm, the files compiled into it) on a cluster with Helm's
// own action package, as `helm install`, `helm upgrade` and `helm
// uninstall` do: the release is stored in its namespace as Helm stores it,
// CRDs go first, and objects are applied server-side.
package helmrelease

import (
	"context"
	"fmt"
	"time"

	"helm.sh/helm/v4/pkg/action"
	"helm.sh/helm/v4/pkg/kube"
	"k8s.io/cli-runtime/pkg/genericclioptions"

	"github.com/tessera-dev/tessera/deployments/helm"
)

// Timeout bounds each Helm operation, as `helm --timeout` does.
const Timeout = 2 * time.Minute

// Client runs Helm's actions for releases in one namespace of the cluster a
// kubeconfig file names.
type Client struct {
	cfg       *action.Configuration
	namespace string
}

// New returns a client for releases in namespace, as `helm --kubeconfig
// kubeconfig --namespace namespace` would act.
func New(kubeconfig, namespace string) (*Client, error) {
	flags := genericclioptions.NewConfigFlags(false)
	flags.KubeConfig = &kubeconfig
	flags.Namespace = &namespace
	cfg := action.NewConfiguration()
	if err := cfg.Init(flags, namespace, "secret"); err != nil {
		return nil, fmt.Errorf("helm configuration for namespace %s: %w", namespace, err)
	}
	return &Client{cfg: cfg, namespace: namespace}, nil
}

// Install installs the chart as release name with values, creating the
// namespace (`helm install --create-namespace`). It does not wait for the
// workloads to become ready: callers check what they need.
func (c *Client) Install(ctx context.Context, name string, values map[string]any) error {
	chart, err := helm.Load()
	if err != nil {
		return err
	}
	in := action.NewInstall(c.cfg)
	in.ReleaseName = name
	in.Namespace = c.namespace
	in.CreateNamespace = true
	in.WaitStrategy = kube.HookOnlyStrategy
	in.Timeout = Timeout
	if _, err := in.RunWithContext(ctx, chart, values); err != nil {
		return fmt.Errorf("helm install %s in namespace %s: %w", name, c.namespace, err)
	}
	return nil
}

// Upgrade upgrades release name to the chart with values (`helm upgrade`,
// values replacing the release's).
func (c *Client) Upgrade(ctx context.Context, name string, values map[string]any) error {
	chart, err := helm.Load()
	if err != nil {
		return err
	}
	up := action.NewUpgrade(c.cfg)
	up.Namespace = c.namespace
	up.WaitStrategy = kube.HookOnlyStrategy
	up.Timeout = Timeout
	if _, err := up.RunWithContext(ctx, name, chart, values); err != nil {
		return fmt.Errorf("helm upgrade %s in namespace %s: %w", name, c.namespace, err)
	}
	return nil
}

// Uninstall deletes release name and every object it created (`helm
// uninstall --wait`: it returns once they are gone).
func (c *Client) Uninstall(name string) error {
	un := action.NewUninstall(c.cfg)
	un.WaitStrategy = kube.StatusWatcherStrategy
	un.Timeout = Timeout
	if _, err := un.Run(name); err != nil {
		return fmt.Errorf("helm uninstall %s in namespace %s: %w", name, c.namespace, err)
	}
	return nil
}
