// Package cli implements the tessera command-line tool's subcommands.
package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"sigs.k8s.io/yaml"

	"k8s.io/component-base/featuregate"

	"github.com/tessera-dev/tessera/driver/discovery"
	"github.com/tessera-dev/tessera/driver/fakenode"
	"github.com/tessera-dev/tessera/driver/features"
	"github.com/tessera-dev/tessera/driver/inventory"
	"github.com/tessera-dev/tessera/driver/lazymig"
	"github.com/tessera-dev/tessera/driver/nodeopen"
	"github.com/tessera-dev/tessera/driver/slices"
)

// KubectlPlugin is the name kubectl finds the tool by on PATH: `kubectl
// tessera ARGS` runs kubectl-tessera ARGS.
const KubectlPlugin = "kubectl-tessera"

// Name is what the tool calls itself in its usage, from the name it was
// run as (os.Args[0]): "kubectl tessera" as a kubectl plugin, else
// "tessera".
func Name(arg0 string) string {
	if strings.TrimSuffix(filepath.Base(arg0), ".exe") == KubectlPlugin {
		return "kubectl tessera"
	}
	return "tessera"
}

// NewCommand returns the root command, whose usage and help call it name
// (see Name).
func NewCommand(name string) *cobra.Command {
	root := &cobra.Command{
		Use:          "tessera",
		Short:        "Inspect and troubleshoot the Tessera GPU DRA driver",
		SilenceUsage: true,
		Annotations:  map[string]string{cobra.CommandDisplayNameAnnotation: name},
	}
	root.AddCommand(newInspectCommand(), newExplainCommand())
	return root
}

func newInspectCommand() *cobra.Command {
	var node nodeopen.Options
	var output, compare string
	gates := features.New()
	cmd := &cobra.Command{
		Use:   "inspect",
		Short: "Print the ResourceSlices this node would publish",
		Long: "Discovers the node's GPUs through NVML (or a simulated node with --fake-node)\n" +
			"and prints the ResourceSlices the kubelet plugin would publish for them.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if output != "yaml" && output != "json" {
				return fmt.Errorf("-o %q: want yaml or json", output)
			}
			if err := node.Validate(); err != nil {
				return err
			}
			if compare != "" {
				return InspectCompare(cmd.Context(), cmd.OutOrStdout(), node, compare)
			}
			return Inspect(cmd.Context(), cmd.OutOrStdout(), node, output, gates)
		},
	}
	node.AddFlags(cmd.Flags())
	gates.AddFlag(cmd.Flags())
	cmd.Flags().StringVarP(&output, "output", "o", "yaml", "Output format: yaml or json.")
	cmd.Flags().StringVar(&compare, "compare", "", fmt.Sprintf("Instead of slices, print every difference between this node's GPUs, read through NVML without changing anything, and a simulated node profile (one of %v): product, memory, power, MIG profiles with their IDs and placements, topology.", fakenode.Profiles()))
	return cmd
}

// InspectCompare discovers the node's GPUs (read only: discovery changes no
// GPU setting) and writes their differences from the named simulated
// profile, under a header naming the node, its driver and the date.
func InspectCompare(ctx context.Context, w io.Writer, opts nodeopen.Options, profile string) error {
	p, err := fakenode.Lookup(profile)
	if err != nil {
		return fmt.Errorf("--compare: %w", err)
	}
	gpus, err := discover(ctx, opts)
	if err != nil {
		return err
	}
	driver := "unknown"
	if len(gpus) > 0 {
		driver = gpus[0].DriverVersion
	}
	source := "real NVML"
	if opts.FakeNode != "" {
		source = "simulated node " + opts.FakeNode
	}
	header := fmt.Sprintf("# tessera inspect --compare %s: %d GPUs of %s, driver %s, %s", profile, len(gpus), source, driver, time.Now().UTC().Format("2006-01-02"))
	return writeComparison(w, header, Compare(gpus, p))
}

// Inspect writes the node's slices to w as a YAML stream or a JSON list.
func Inspect(ctx context.Context, w io.Writer, opts nodeopen.Options, output string, gates featuregate.FeatureGate) error {
	gpus, err := discover(ctx, opts)
	if err != nil {
		return err
	}
	inv := inventory.Build(gpus, inventory.Options{DynamicMIG: gates.Enabled(features.DynamicMIG)})
	var sopts slices.Options
	if gates.Enabled(features.LazyMIG) {
		// As the plugin publishes a node that holds no claim yet.
		d := slices.Unheld(inv, lazymig.DefaultPolicy)
		sopts.Lazy = &d
	}
	res, err := slices.Build(opts.NodeName, inv, sopts)
	if err != nil {
		return err
	}
	objs := slices.Objects(opts.NodeName, res)
	if output == "json" {
		list := map[string]any{"apiVersion": "v1", "kind": "List", "items": objs}
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(list)
	}
	for i, o := range objs {
		data, err := yaml.Marshal(o)
		if err != nil {
			return err
		}
		if i > 0 {
			fmt.Fprintln(w, "---")
		}
		if _, err := w.Write(data); err != nil {
			return err
		}
	}
	return nil
}

// discover opens the node the options name, reads its GPUs and closes it.
// A simulated node is opened afresh, in a directory of its own (--fake-root
// or a temporary one, removed after) and without the driver state a plugin
// keeps: the command prints the same whatever ran before it, and leaves
// nothing behind.
func discover(ctx context.Context, opts nodeopen.Options) ([]discovery.GPU, error) {
	if opts.FakeNode != "" && opts.Opened == nil {
		opts.Ephemeral = true
		if opts.FakeRoot == "" {
			dir, err := os.MkdirTemp("", "tessera-"+opts.FakeNode+"-")
			if err != nil {
				return nil, fmt.Errorf("fake node %s: a directory for its host files: %w (set TMPDIR or --fake-root to a writable directory)", opts.FakeNode, err)
			}
			defer func() { _ = os.RemoveAll(dir) }()
			opts.FakeRoot = dir
		}
	}
	n, err := opts.Open()
	if err != nil {
		return nil, err
	}
	defer func() { _ = n.Close() }()
	gpus, err := discovery.Discover(ctx, n)
	if err != nil {
		return nil, fmt.Errorf("discover GPUs: %w", err)
	}
	return gpus, nil
}
