package cli

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// clientConfig loads the API client configuration as kubectl does: the
// file --kubeconfig names (explicit), else the files KUBECONFIG lists, else
// ~/.kube/config, else the pod's service account. Where none of them names
// a cluster, the error says where it looked and how to point the command at
// one; client-go's own answer ("try setting KUBERNETES_MASTER") names none
// of the places a kubectl user keeps a kubeconfig.
func clientConfig(explicit string) (*rest.Config, error) {
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = explicit
	cfg, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{}).ClientConfig()
	switch {
	case err == nil:
		return cfg, nil
	case clientcmd.IsEmptyConfig(err):
		return nil, noCluster(rules)
	case explicit != "":
		return nil, fmt.Errorf("--kubeconfig %s: %w", explicit, err)
	default:
		return nil, fmt.Errorf("load kubeconfig %s: %w (point --kubeconfig or KUBECONFIG at a kubeconfig file)", strings.Join(rules.Precedence, string(os.PathListSeparator)), err)
	}
}

// noCluster says, for each place clientConfig looked, why it found no
// cluster there, and how to name one.
func noCluster(rules *clientcmd.ClientConfigLoadingRules) error {
	var looked []string
	if rules.ExplicitPath != "" {
		looked = append(looked, "--kubeconfig "+rules.ExplicitPath+" "+noClusterIn(rules.ExplicitPath))
	} else {
		looked = append(looked, "--kubeconfig is not set")
		if env, ok := os.LookupEnv(clientcmd.RecommendedConfigPathEnvVar); ok && env != "" {
			var files []string
			for _, f := range rules.Precedence {
				files = append(files, f+" "+noClusterIn(f))
			}
			looked = append(looked, clientcmd.RecommendedConfigPathEnvVar+"="+env+": "+strings.Join(files, ", "))
		} else {
			looked = append(looked, clientcmd.RecommendedConfigPathEnvVar+" is not set")
			for _, f := range rules.Precedence {
				looked = append(looked, f+" "+noClusterIn(f))
			}
		}
	}
	inCluster := "not in a pod"
	if _, err := rest.InClusterConfig(); errors.Is(err, rest.ErrNotInCluster) {
		inCluster += " (KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are not set)"
	} else if err != nil {
		inCluster = "no in-cluster configuration (" + err.Error() + ")"
	}
	looked = append(looked, inCluster)
	fix := "point it at one with --kubeconfig=PATH or KUBECONFIG=PATH"
	if strings.Contains(strings.Join(looked, ", "), noContext) {
		fix += ", or choose a context with kubectl config use-context NAME"
	}
	return fmt.Errorf("no cluster to ask: %s; %s", strings.Join(looked, ", "), fix)
}

// noContext is what noClusterIn says of a kubeconfig without a current
// context.
const noContext = "has no current context"

// noClusterIn says why a kubeconfig file names no cluster.
func noClusterIn(path string) string {
	if _, err := os.Stat(path); errors.Is(err, os.ErrNotExist) {
		return "does not exist"
	}
	cfg, err := clientcmd.LoadFromFile(path)
	if err != nil {
		return "cannot be read (" + err.Error() + ")"
	}
	if cfg.CurrentContext == "" {
		return noContext
	}
	return "names no cluster"
}
