// Package imexd is the simulated driver's nvidia-imex: a stand-in for
// NVIDIA's IMEX daemon that reads the daemon's configuration and holds its
// TCP port, so that on a fake node the plugin's IMEX daemon pods start,
// become ready and stop as they would on a real one.
//
// It reads what NVIDIA documents for the IMEX service
// (https://docs.nvidia.com/multi-node-nvlink-systems/imex-guide/config.html)
// and refuses what the daemon could not run with:
//
//   - nvidia-imex -c <config file> [-p|--port N]: -c names the config (the
//     daemon has a default path; the stand-in insists on being told), -p or
//     --port overrides the config's SERVER_PORT.
//   - The config is KEY=VALUE lines; blank lines and lines starting with #
//     are ignored, and so are keys the stand-in has no use for. An empty
//     value is the key's default.
//   - SERVER_PORT: the TCP port, 0 to 65535, 50000 by default (0 lets the
//     kernel choose; the stand-in prints the port it got).
//   - IMEX_NODE_CONFIG_FILE: the nodes config, DefaultNodesConfig by
//     default: the IP address of each node of the IMEX domain, one a line
//     (blank lines and # comments ignored), each once, at least one.
//   - BIND_INTERFACE_IP: the address to listen on. Empty (the default), the
//     daemon listens on the first address of the nodes config that one of
//     this machine's interfaces has. The stand-in also insists that a
//     BIND_INTERFACE_IP be in the nodes config, where its peers look for it.
//   - DAEMONIZE: 1 (NVIDIA's default) makes the daemon fork into the
//     background, which ends a container whose process it is; the stand-in
//     runs in the foreground only and refuses anything but DAEMONIZE=0.
//
// It speaks no IMEX protocol: it accepts each connection and closes it at
// once, which is what a kubelet tcpSocket readiness probe needs, until its
// context is cancelled (the command: SIGTERM or SIGINT), and then returns
// nil. Every mistake is an error naming the argument, key, or file and line
// at fault, and what to change.
//
// Its standard output is its contract with the tests and the end-to-end
// tests that read the container's log: one line per node of the nodes
// config, in its order, numbered from 0, then one line once it listens:
//
//	IMEX node 0: 10.1.2.3
//	IMEX node 1: 10.1.2.4
//	IMEX daemon listening on 10.1.2.3:50000, 2 nodes
//
// The address is host:port as Go writes it ([fd00::1]:50000 for IPv6).
package imexd

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
)

// NVIDIA's defaults.
const (
	DefaultPort        = 50000
	DefaultNodesConfig = "/etc/nvidia-imex/nodes_config.cfg"
)

// Run is nvidia-imex with the given arguments (without the program's name):
// it reads the configuration, prints the nodes, listens, calls ready (when
// not nil) with the address it listens on, and serves until ctx is
// cancelled.
func Run(ctx context.Context, args []string, stdout io.Writer, ready func(net.Addr)) error {
	a, err := parseArgs(args)
	if err != nil {
		return err
	}
	cfg, err := readConfig(a.config)
	if err != nil {
		return err
	}
	portFrom := "SERVER_PORT in " + a.config
	if a.portFlag != "" {
		cfg.port, portFrom = a.port, a.portFlag
	}
	nodes, err := readNodes(cfg.nodesFile)
	if err != nil {
		return err
	}
	bind, bindFrom, err := chooseBind(cfg, nodes)
	if err != nil {
		return err
	}
	for i, n := range nodes {
		fmt.Fprintf(stdout, "IMEX node %d: %s\n", i, n)
	}
	addr := netip.AddrPortFrom(bind, uint16(cfg.port)).String()
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", addr)
	if err != nil {
		err = fmt.Errorf("listen on %s (address from %s, port from %s): %w", addr, bindFrom, portFrom, err)
		switch {
		case errors.Is(err, syscall.EADDRINUSE):
			err = fmt.Errorf("%w: stop what holds the port, or choose another with SERVER_PORT or -p/--port", err)
		case errors.Is(err, syscall.EADDRNOTAVAIL):
			err = fmt.Errorf("%w: BIND_INTERFACE_IP must be an address of one of this machine's interfaces", err)
		}
		return err
	}
	fmt.Fprintf(stdout, "IMEX daemon listening on %s, %d nodes\n", ln.Addr(), len(nodes))
	if ready != nil {
		ready(ln.Addr())
	}
	return serve(ctx, ln)
}

// serve closes each connection as it comes until ctx is cancelled. The
// listener is closed when it returns.
func serve(ctx context.Context, ln net.Listener) error {
	failed := make(chan error, 1)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				failed <- err
				return
			}
			_ = c.Close()
		}
	}()
	select {
	case <-ctx.Done():
		// Close returns once the socket is closed: when Run returns, the
		// port no longer accepts.
		err := ln.Close()
		<-failed
		if err != nil {
			return fmt.Errorf("close %s: %w", ln.Addr(), err)
		}
		return nil
	case err := <-failed:
		_ = ln.Close()
		return fmt.Errorf("accept on %s: %w", ln.Addr(), err)
	}
}

type arguments struct {
	config   string
	port     int
	portFlag string // the flag that set port as given (-p, --port); empty when none did
}

func parseArgs(args []string) (arguments, error) {
	var a arguments
	for i := 0; i < len(args); i++ {
		name, value, hasValue := strings.Cut(args[i], "=")
		switch name {
		case "-c", "-p", "--port":
		default:
			return a, fmt.Errorf("unknown argument %q: the stand-in takes -c <config file> and -p|--port <port>", args[i])
		}
		if !hasValue {
			if i+1 == len(args) {
				return a, fmt.Errorf("%s needs a value", name)
			}
			i++
			value = args[i]
		}
		if name == "-c" {
			a.config = value
			continue
		}
		port, err := parsePort(value)
		if err != nil {
			return a, fmt.Errorf("%s %q: %w", name, value, err)
		}
		a.port, a.portFlag = port, name
	}
	if a.config == "" {
		return a, errors.New("no config file: run nvidia-imex -c <config file>")
	}
	return a, nil
}

func parsePort(s string) (int, error) {
	p, err := strconv.Atoi(s)
	if err != nil || p < 0 || p > 65535 {
		return 0, errors.New("want a TCP port, 0 to 65535")
	}
	return p, nil
}

type config struct {
	port      int
	nodesFile string
	bind      netip.Addr // the zero Addr when unset
}

func readConfig(path string) (config, error) {
	cfg := config{port: DefaultPort, nodesFile: DefaultNodesConfig}
	data, err := os.ReadFile(path)
	if err != nil {
		return cfg, fmt.Errorf("read the config: %w", err)
	}
	daemonize, daemonizeLine := "", 0
	for i, line := range strings.Split(string(data), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		at := fmt.Sprintf("%s line %d", path, i+1)
		key, value, ok := strings.Cut(line, "=")
		key, value = strings.TrimSpace(key), strings.TrimSpace(value)
		if !ok || key == "" {
			return cfg, fmt.Errorf("%s: %q is not KEY=VALUE", at, line)
		}
		if value == "" {
			continue // the default
		}
		switch key {
		case "SERVER_PORT":
			p, err := parsePort(value)
			if err != nil {
				return cfg, fmt.Errorf("%s: SERVER_PORT=%s: %w (NVIDIA's default is %d)", at, value, err, DefaultPort)
			}
			cfg.port = p
		case "IMEX_NODE_CONFIG_FILE":
			cfg.nodesFile = value
		case "BIND_INTERFACE_IP":
			ip, err := netip.ParseAddr(value)
			if err != nil {
				return cfg, fmt.Errorf("%s: BIND_INTERFACE_IP=%q is not an IP address: give one of the nodes config's, or leave it empty", at, value)
			}
			cfg.bind = ip.Unmap()
		case "DAEMONIZE":
			daemonize, daemonizeLine = value, i+1
		}
	}
	switch {
	case daemonize == "":
		return cfg, fmt.Errorf("%s: DAEMONIZE is not set, and NVIDIA's default is 1 (fork into the background); the stand-in runs in the foreground only, as a container's process must: set DAEMONIZE=0", path)
	case daemonize != "0":
		return cfg, fmt.Errorf("%s line %d: DAEMONIZE=%s: the stand-in runs in the foreground only, as a container's process must: set DAEMONIZE=0", path, daemonizeLine, daemonize)
	}
	return cfg, nil
}

func readNodes(path string) ([]netip.Addr, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("read the nodes config (IMEX_NODE_CONFIG_FILE): %w: write the IP address of each node of the IMEX domain there, one a line", err)
	}
	defer func() { _ = f.Close() }()
	var nodes []netip.Addr
	lineOf := map[netip.Addr]int{}
	s := bufio.NewScanner(f)
	for n := 1; s.Scan(); n++ {
		line := strings.TrimSpace(s.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		ip, err := netip.ParseAddr(line)
		if err != nil {
			return nil, fmt.Errorf("%s line %d: %q is not an IP address: the nodes config lists one IP address a line", path, n, line)
		}
		ip = ip.Unmap()
		if first, ok := lineOf[ip]; ok {
			return nil, fmt.Errorf("%s line %d: %s is listed again (first at line %d): list each node once", path, n, ip, first)
		}
		lineOf[ip] = n
		nodes = append(nodes, ip)
	}
	if err := s.Err(); err != nil {
		return nil, fmt.Errorf("read the nodes config %s: %w", path, err)
	}
	if len(nodes) == 0 {
		return nil, fmt.Errorf("%s lists no node: write the IP address of each node of the IMEX domain there, one a line", path)
	}
	return nodes, nil
}

// chooseBind picks the address to listen on, and says where it came from.
func chooseBind(cfg config, nodes []netip.Addr) (netip.Addr, string, error) {
	if cfg.bind.IsValid() {
		if !slices.Contains(nodes, cfg.bind) {
			return netip.Addr{}, "", fmt.Errorf("BIND_INTERFACE_IP=%s is not in the nodes config %s: list it there, or leave BIND_INTERFACE_IP empty for this machine's address of the list", cfg.bind, cfg.nodesFile)
		}
		return cfg.bind, "BIND_INTERFACE_IP", nil
	}
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return netip.Addr{}, "", fmt.Errorf("list this machine's addresses (to find its own in the nodes config %s): %w", cfg.nodesFile, err)
	}
	var local []netip.Addr
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok {
			if ip, ok := netip.AddrFromSlice(n.IP); ok {
				local = append(local, ip.Unmap())
			}
		}
	}
	for _, n := range nodes {
		if slices.Contains(local, n.WithZone("")) {
			return n, "the nodes config " + cfg.nodesFile, nil
		}
	}
	return netip.Addr{}, "", fmt.Errorf("no address of the nodes config %s is on this machine (it has %v): list there the address of this node's interface the IMEX domain reaches it at", cfg.nodesFile, local)
}
