package cluster

import (
	"bytes"
	"net"
	"testing"
)

// TestNodeIPsAreTheSubnetsAddressesNoNodeHandsOut checks that each of the
// real-runtime nodes a pod network holds gets its own address of the
// subnet, which is not the network's, the gateway's or the broadcast
// address, and which no node hands out to its pods.
func TestNodeIPsAreTheSubnetsAddressesNoNodeHandsOut(t *testing.T) {
	p := &podNetwork{
		subnet:  &net.IPNet{IP: net.IPv4(10, 244, 7, 0).To4(), Mask: net.CIDRMask(24, 32)},
		gateway: net.IPv4(10, 244, 7, 1).To4(),
	}
	inRange := func(ip net.IP, j int) bool {
		first, last := p.nodeRange(j)
		return bytes.Compare(ip, first) >= 0 && bytes.Compare(ip, last) <= 0
	}
	seen := map[string]int{}
	for i := range maxRealNodes {
		ip := p.nodeIP(i)
		if !p.subnet.Contains(ip) || ip.IsLoopback() {
			t.Errorf("node %d: address %s is not in the subnet %s, or loopback", i, ip, p.subnet)
		}
		if last := ip[3]; last == 0 || last == 255 || ip.Equal(p.gateway) {
			t.Errorf("node %d: address %s is the network's, the broadcast address or the gateway %s", i, ip, p.gateway)
		}
		if j, ok := seen[ip.String()]; ok {
			t.Errorf("nodes %d and %d both get %s", j, i, ip)
		}
		seen[ip.String()] = i
		for j := range maxRealNodes {
			if inRange(ip, j) {
				first, last := p.nodeRange(j)
				t.Errorf("node %d: address %s is in node %d's range %s-%s", i, ip, j, first, last)
			}
		}
	}
	// The eighth node's range ends short of the broadcast address, and
	// every node keeps its 30 (29) addresses.
	for j := range maxRealNodes {
		first, last := p.nodeRange(j)
		want := 30
		if j == maxRealNodes-1 {
			want = 29
		}
		if n := int(last[3]) - int(first[3]) + 1; n != want || last[3] == 255 {
			t.Errorf("node %d: range %s-%s holds %d addresses, want %d short of the broadcast address", j, first, last, n, want)
		}
	}
	if got := p.nodeIP(0).String(); got != "10.244.7.32" {
		t.Errorf("the first node's address is %s, want 10.244.7.32", got)
	}
}
