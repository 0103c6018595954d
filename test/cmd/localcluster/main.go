// Command localcluster runs a local Tessera test cluster (test/cluster) until
// interrupted, for demos and for poking at by hand with kubectl.
//
//	go run ./test/cmd/localcluster --nodes gpu-node-1,gpu-node-2
//	export KUBECONFIG=<printed path>
//
// Ctrl-C stops every component and unmounts; the directory is kept.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"k8s.io/klog/v2"

	"github.com/tessera-dev/tessera/test/cluster"
)

func main() {
	dir := flag.String("dir", "", "cluster directory (default: a new one under $TMPDIR)")
	nodes := flag.String("nodes", "gpu-node-1", "comma-separated node names")
	real := flag.String("real-nodes", "", "comma-separated names of further nodes that run containers with containerd and runc")
	klog.InitFlags(nil)
	flag.Parse()
	if err := run(*dir, strings.Split(*nodes, ","), strings.Split(*real, ",")); err != nil {
		fmt.Fprintf(os.Stderr, "localcluster: %v\n", err)
		os.Exit(1)
	}
}

func run(dir string, nodeNames, realNames []string) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if dir == "" {
		var err error
		if dir, err = os.MkdirTemp("", "tessera-"); err != nil {
			return fmt.Errorf("create cluster dir: %w", err)
		}
	}
	opts := cluster.Options{Dir: dir}
	for _, name := range nodeNames {
		if name = strings.TrimSpace(name); name != "" {
			opts.Nodes = append(opts.Nodes, cluster.NodeSpec{Name: name})
		}
	}
	for _, name := range realNames {
		if name = strings.TrimSpace(name); name != "" {
			opts.Nodes = append(opts.Nodes, cluster.NodeSpec{Name: name, Runtime: cluster.RealContainerd})
		}
	}
	c, err := cluster.Start(ctx, opts)
	if err != nil {
		return err
	}
	defer c.Stop()
	fmt.Printf("cluster running in %s\nexport KUBECONFIG=%s\n", c.Dir(), c.AdminKubeconfig())
	for _, n := range c.Nodes() {
		fmt.Printf("node %s: kubelet root %s, CDI dir %s, kubelet log %s\n", n.Name(), n.KubeletRootDir(), n.CDIDir(), n.KubeletLog())
	}
	fmt.Println("press Ctrl-C to stop")
	<-ctx.Done()
	fmt.Println("stopping")
	return nil
}
