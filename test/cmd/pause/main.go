// Command pause is the sandbox process of the test cluster's real-runtime
// pods (what registry.k8s.io/pause does on real nodes): it holds the pod's
// namespaces, reaps the orphans it inherits as the pod's init, and exits on
// SIGINT or SIGTERM. test/ociimage builds it statically into the pause image.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range signals {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var status syscall.WaitStatus
			if pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil); pid <= 0 || err != nil {
				break
			}
		}
	}
}
