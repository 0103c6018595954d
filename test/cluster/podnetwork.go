package cluster

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"k8s.io/klog/v2"
)

// A cluster with real-runtime nodes has one pod network: a bridge in the
// host's network namespace that every such node's CNI bridge plugin attaches
// its pods to, with the subnet 10.244.K.0/24 (K free on this machine, chosen
// under a lock shared by every cluster here) and the address 10.244.K.1 on
// the host side. Pods reach each other and the host on that address, and the
// control plane (the API server calling a webhook, the kubelet probing a
// pod) reaches pods; the network has no gateway out and no masquerading, so
// nothing leaves the machine. Each node hands out its own part of the
// subnet (nodeRange).
//
// Each real-runtime node also has its own address of the subnet on the
// bridge (nodeIP, Node.IP), one that no node hands out: its kubelet's
// --node-ip, so its Node's InternalIP and its hostNetwork pods' hostIP and
// podIP. The kubelet serves there (the API server reaches it there for
// logs and exec) and probes hostNetwork pods there; processes of any node
// can bind to it, pods reach it as they reach the host. Being on the
// bridge it goes with the bridge.
//
// The API server listens on 127.0.0.1 only, and the cluster runs no Service
// proxy, so pods in the pod network reach the API server through a relay on
// 10.244.K.1 at the API server's port (PodAPIServer): it carries bytes to
// 127.0.0.1 and nothing else, for connections from the pod subnet only;
// TLS ends at the API server, whose certificate names 10.244.K.1. Pods
// also reach whatever else the host serves on all its addresses.
type podNetwork struct {
	bridge  string
	subnet  *net.IPNet
	gateway net.IP

	mu     sync.Mutex
	relay  net.Listener
	conns  map[net.Conn]bool
	closed bool
	wg     sync.WaitGroup
}

// podNetworkLock serialises the choice of subnets between clusters on this
// machine (whatever their TMPDIR): each picks a subnet that no address or
// route of the machine overlaps and puts it on its bridge while holding it.
const podNetworkLock = "/run/tessera-pod-networks.lock"

// maxRealNodes is how many real-runtime nodes share a pod network: each
// hands out 30 addresses (nodeRange).
const maxRealNodes = 8

// newPodNetwork creates the bridge of the cluster living in dir, with a
// subnet of 10.244.0.0/16 that no interface of this machine has.
func newPodNetwork(dir string) (*podNetwork, error) {
	sum := sha256.Sum256([]byte(dir))
	p := &podNetwork{bridge: fmt.Sprintf("tsr%x", sum[:5]), conns: map[net.Conn]bool{}} // at most 15 bytes
	lock, err := os.OpenFile(podNetworkLock, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open the pod network lock: %w", err)
	}
	defer func() { _ = lock.Close() }()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return nil, fmt.Errorf("lock %s: %w", podNetworkLock, err)
	}
	taken, err := takenSubnets()
	if err != nil {
		return nil, err
	}
	for k := range 256 {
		if taken[k] {
			continue
		}
		p.subnet = &net.IPNet{IP: net.IPv4(10, 244, byte(k), 0).To4(), Mask: net.CIDRMask(24, 32)}
		p.gateway = net.IPv4(10, 244, byte(k), 1).To4()
		break
	}
	if p.subnet == nil {
		return nil, errors.New("an address or route of this machine overlaps every /24 of 10.244.0.0/16: delete the tsr* bridges that stopped clusters left behind (ip link delete tsr...)")
	}
	for _, args := range [][]string{
		{"link", "add", "name", p.bridge, "type", "bridge"},
		{"addr", "add", p.gateway.String() + "/24", "dev", p.bridge},
		{"link", "set", p.bridge, "up"},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			p.deleteBridge(klog.Background())
			return nil, fmt.Errorf("create the pod bridge: ip %s: %w: %s", strings.Join(args, " "), err, out)
		}
	}
	return p, nil
}

// takenSubnets returns which 10.244.K.0/24 overlap a network of this
// machine: an interface's (with its prefix length) or a route's
// destination, the default route aside.
func takenSubnets() (map[int]bool, error) {
	var used []*net.IPNet
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil, fmt.Errorf("list this machine's addresses: %w", err)
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && n.IP.To4() != nil {
			used = append(used, &net.IPNet{IP: n.IP.Mask(n.Mask), Mask: n.Mask})
		}
	}
	out, err := exec.Command("ip", "-4", "route", "show", "table", "all").Output()
	if err != nil {
		return nil, fmt.Errorf("list this machine's routes: ip -4 route show table all: %w", err)
	}
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) > 1 && slices.Contains([]string{"unicast", "local", "broadcast", "multicast", "anycast", "blackhole", "unreachable", "prohibit", "throw"}, f[0]) {
			f = f[1:]
		}
		if len(f) == 0 || f[0] == "default" {
			continue
		}
		dst := f[0]
		if !strings.Contains(dst, "/") {
			dst += "/32"
		}
		if _, n, err := net.ParseCIDR(dst); err == nil {
			used = append(used, n)
		}
	}
	taken := map[int]bool{}
	for k := range 256 {
		candidate := &net.IPNet{IP: net.IPv4(10, 244, byte(k), 0).To4(), Mask: net.CIDRMask(24, 32)}
		for _, n := range used {
			if n.Contains(candidate.IP) || candidate.Contains(n.IP) {
				taken[k] = true
				break
			}
		}
	}
	return taken, nil
}

// nodeRange is the part of the subnet the i-th real-runtime node's pods get
// their addresses from: 30 (29 for the eighth node, short of the broadcast
// address).
func (p *podNetwork) nodeRange(i int) (first, last net.IP) {
	return p.host(32*i + 2), p.host(min(32*i+31, 254))
}

// nodeIP is the i-th real-runtime node's own address (Node.IP). The
// addresses of the subnet that are neither the network's (.0), the
// gateway's (.1), the broadcast address (.255) nor in a node's range are
// the two below each range from the second node's on: .32 and .33, .64 and
// .65, and so on; the i-th node gets the i-th of them (.32, .33, .64, ...,
// .129 for the eighth). The top of the subnet is the eighth node's range.
func (p *podNetwork) nodeIP(i int) net.IP {
	return p.host(32*(i/2+1) + i%2)
}

// host is the address of the subnet whose last byte is b.
func (p *podNetwork) host(b int) net.IP {
	base := p.subnet.IP.To4()
	return net.IPv4(base[0], base[1], base[2], byte(b)).To4()
}

// addNodeIP puts the i-th real-runtime node's address on the bridge and
// returns it. It goes on as a /32: the bridge's route to the subnet keeps
// the gateway as its source address, so what the host sends to pods (the
// kubelet's probes, the API server's webhook calls) comes from the gateway
// as before; pods still reach the address on the bridge (the host answers
// ARP for any of its addresses).
func (p *podNetwork) addNodeIP(i int) (net.IP, error) {
	ip := p.nodeIP(i)
	if out, err := exec.Command("ip", "addr", "add", ip.String()+"/32", "dev", p.bridge).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("put the node's address on the pod bridge: ip addr add %s/32 dev %s: %w: %s", ip, p.bridge, err, out)
	}
	return ip, nil
}

// startRelay carries connections to the host side's address at port to
// the API server on 127.0.0.1:port.
func (p *podNetwork) startRelay(ctx context.Context, port int) error {
	logger := klog.FromContext(ctx)
	addr := net.JoinHostPort(p.gateway.String(), strconv.Itoa(port))
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("listen on %s for pods that call the API server: %w", addr, err)
	}
	p.relay = l
	target := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	p.wg.Go(func() {
		for {
			in, err := l.Accept()
			if err != nil {
				return
			}
			// Pods only: the host's weak address model would otherwise let
			// any machine that routes the subnet here reach the API server.
			if from, ok := in.RemoteAddr().(*net.TCPAddr); !ok || !p.subnet.Contains(from.IP) {
				logger.Info("Refused a connection to the API server's relay from outside the pod network", "from", in.RemoteAddr())
				_ = in.Close()
				continue
			}
			out, err := net.Dial("tcp", target)
			if err != nil {
				logger.Error(err, "Relaying a pod's connection to the API server failed", "from", in.RemoteAddr())
				_ = in.Close()
				continue
			}
			if !p.track(in, out) {
				return
			}
			p.wg.Go(func() { p.pipe(in, out) })
		}
	})
	return nil
}

// track records a relayed connection's two ends, unless the relay stopped.
func (p *podNetwork) track(conns ...net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		for _, c := range conns {
			_ = c.Close()
		}
		return false
	}
	for _, c := range conns {
		p.conns[c] = true
	}
	return true
}

// pipe copies between a and b until either side ends, then closes both.
func (p *podNetwork) pipe(a, b net.Conn) {
	done := make(chan struct{}, 2)
	go func() { _, _ = io.Copy(a, b); done <- struct{}{} }()
	go func() { _, _ = io.Copy(b, a); done <- struct{}{} }()
	<-done
	p.mu.Lock()
	delete(p.conns, a)
	delete(p.conns, b)
	p.mu.Unlock()
	_ = a.Close()
	_ = b.Close()
	<-done
}

// stop ends the relay and its connections, and deletes the bridge.
func (p *podNetwork) stop(ctx context.Context) {
	p.mu.Lock()
	p.closed = true
	if p.relay != nil {
		_ = p.relay.Close()
	}
	for c := range p.conns {
		_ = c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
	p.deleteBridge(klog.FromContext(ctx))
}

func (p *podNetwork) deleteBridge(logger klog.Logger) {
	if out, err := exec.Command("ip", "link", "delete", p.bridge).CombinedOutput(); err != nil && !strings.Contains(string(out), "Cannot find device") {
		logger.Error(err, "Deleting the pod bridge failed", "bridge", p.bridge, "output", string(out))
	}
}

// PodAPIServer is the address (host and port) at which pods in the pod
// network reach the API server, for KUBERNETES_SERVICE_HOST and
// KUBERNETES_SERVICE_PORT; ok is false if the cluster has no real-runtime
// node, hence no pod network.
func (c *Cluster) PodAPIServer() (host, port string, ok bool) {
	if c.pods == nil || c.pods.relay == nil {
		return "", "", false
	}
	host, port, err := net.SplitHostPort(c.pods.relay.Addr().String())
	return host, port, err == nil
}
