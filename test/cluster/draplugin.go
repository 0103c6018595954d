package cluster

import (
	"bufio"
	"fmt"
	"os"
	"strings"
)

// DRAPluginRegistrations counts how often the node's kubelet has registered
// a DRA plugin of the driver, over all of the kubelet's runs, from its log
// ("Registered DRA plugin"). Compare counts from before and after a plugin or
// kubelet restart to know when the kubelet can call the plugin again: pods
// that arrive earlier fail to prepare and wait for the kubelet's back-off.
func (n *Node) DRAPluginRegistrations(driver string) (int, error) {
	f, err := os.Open(n.KubeletLog())
	if err != nil {
		return 0, fmt.Errorf("node %s: read kubelet log: %w", n.name, err)
	}
	defer func() { _ = f.Close() }()
	count := 0
	s := bufio.NewScanner(f)
	s.Buffer(make([]byte, 0, 64*1024), 4*1024*1024)
	name := fmt.Sprintf("driverName=%q", driver)
	for s.Scan() {
		if line := s.Text(); strings.Contains(line, `"Registered DRA plugin"`) && strings.Contains(line, name) {
			count++
		}
	}
	if err := s.Err(); err != nil {
		return 0, fmt.Errorf("node %s: read kubelet log: %w", n.name, err)
	}
	return count, nil
}
