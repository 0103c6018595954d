package imexd_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tessera-dev/tessera/driver/fakenode/imexd"
)

// 198.51.100.0/24 and 203.0.113.0/24 are reserved for documentation (RFC
// 5737), so they stand for the other nodes of an IMEX domain; notHere checks
// that the machine running the tests has neither address.
const (
	otherNode  = "198.51.100.7"
	otherNode2 = "203.0.113.9"
)

func notHere(t *testing.T) {
	t.Helper()
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && (n.IP.String() == otherNode || n.IP.String() == otherNode2) {
			t.Fatalf("this machine has %s, which the tests take for another node's address: change otherNode or otherNode2", n.IP)
		}
	}
}

// files writes the config (NODES in it replaced by the nodes config's path)
// and the nodes config into a fresh directory and returns their paths.
func files(t *testing.T, config, nodes string) (configPath, nodesPath string) {
	t.Helper()
	dir := t.TempDir()
	configPath = filepath.Join(dir, "config.cfg")
	nodesPath = filepath.Join(dir, "nodes_config.cfg")
	if err := os.WriteFile(configPath, []byte(strings.ReplaceAll(config, "NODES", nodesPath)), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(nodesPath, []byte(nodes), 0o644); err != nil {
		t.Fatal(err)
	}
	return configPath, nodesPath
}

// busyPort holds a port on 127.0.0.1 for the test's duration.
func busyPort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Close() })
	return l.Addr().(*net.TCPAddr).Port
}

// freePort is a port on 127.0.0.1 nothing listened on a moment ago.
func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	return port
}

// TestServesTheLocalNodeUntilCancelled: with a nodes config listing another
// node first and 127.0.0.1 second, the stand-in prints both nodes, listens
// on 127.0.0.1 (the one address of the list this machine has, or the one
// BIND_INTERFACE_IP names) at the port the config or -p/--port gives, takes
// a connection and closes it at once (what a kubelet tcpSocket probe needs),
// and returns nil, its port closed, once its context is cancelled.
func TestServesTheLocalNodeUntilCancelled(t *testing.T) {
	notHere(t)
	const nodes = "# an IMEX domain of two nodes\n" + otherNode + "\n\n  127.0.0.1  \n"
	free := freePort(t)
	for _, tt := range []struct {
		name   string
		config string
		args   []string // after -c <config>
		port   int      // 0: any port the kernel chose
	}{
		{
			name:   "port 0 from the config",
			config: "DAEMONIZE=0\nIMEX_NODE_CONFIG_FILE=NODES\nSERVER_PORT=0\n",
		},
		{
			name:   "comments, blanks, spaces and unknown keys",
			config: "# IMEX config\n\n  DAEMONIZE = 0\nIMEX_NODE_CONFIG_FILE=NODES\nSERVER_PORT=0\nIMEX_CMD_PORT=50005\nNETWORK_INTERFACE=\nBIND_INTERFACE_IP=\n",
		},
		{
			name:   "-p overrides SERVER_PORT",
			config: "DAEMONIZE=0\nIMEX_NODE_CONFIG_FILE=NODES\nSERVER_PORT=" + strconv.Itoa(busyPort(t)) + "\n",
			args:   []string{"-p", "0"},
		},
		{
			name:   "--port overrides SERVER_PORT",
			config: "DAEMONIZE=0\nIMEX_NODE_CONFIG_FILE=NODES\nSERVER_PORT=" + strconv.Itoa(busyPort(t)) + "\n",
			args:   []string{"--port", "0"},
		},
		{
			name:   "--port=N overrides SERVER_PORT",
			config: "DAEMONIZE=0\nIMEX_NODE_CONFIG_FILE=NODES\nSERVER_PORT=" + strconv.Itoa(busyPort(t)) + "\n",
			args:   []string{"--port=0"},
		},
		{
			name:   "BIND_INTERFACE_IP",
			config: "DAEMONIZE=0\nIMEX_NODE_CONFIG_FILE=NODES\nSERVER_PORT=0\nBIND_INTERFACE_IP=127.0.0.1\n",
		},
		{
			name:   "SERVER_PORT",
			config: "DAEMONIZE=0\nIMEX_NODE_CONFIG_FILE=NODES\nSERVER_PORT=" + strconv.Itoa(free) + "\n",
			port:   free,
		},
	} {
		t.Run(tt.name, func(t *testing.T) {
			configPath, _ := files(t, tt.config, nodes)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			var out bytes.Buffer
			readyc := make(chan net.Addr, 1)
			done := make(chan error, 1)
			go func() {
				done <- imexd.Run(ctx, append([]string{"-c", configPath}, tt.args...), &out, func(a net.Addr) { readyc <- a })
			}()
			var addr net.Addr
			select {
			case addr = <-readyc:
			case err := <-done:
				t.Fatalf("Run returned before listening: %v\n%s", err, out.String())
			case <-time.After(10 * time.Second):
				t.Fatal("Run did not report its address in 10s")
			}
			tcp, ok := addr.(*net.TCPAddr)
			if !ok || !tcp.IP.Equal(net.IPv4(127, 0, 0, 1)) || tcp.Port == 0 || (tt.port != 0 && tcp.Port != tt.port) {
				t.Errorf("listening on %v, want 127.0.0.1 at port %d (0: any)", addr, tt.port)
			}

			conn, err := net.DialTimeout("tcp", addr.String(), 5*time.Second)
			if err != nil {
				t.Fatalf("connect to %v: %v", addr, err)
			}
			_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
			if n, err := conn.Read(make([]byte, 1)); n != 0 || !errors.Is(err, io.EOF) {
				t.Errorf("read from the stand-in: %d bytes, %v; want it to close the connection at once (EOF)", n, err)
			}
			_ = conn.Close()

			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("Run after cancel: %v, want nil", err)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("Run did not return within 10s of its context's cancel")
			}
			want := "IMEX node 0: " + otherNode + "\nIMEX node 1: 127.0.0.1\nIMEX daemon listening on " + addr.String() + ", 2 nodes\n"
			if got := out.String(); got != want {
				t.Errorf("stdout:\n%s\nwant:\n%s", got, want)
			}
			if c, err := net.DialTimeout("tcp", addr.String(), 5*time.Second); err == nil {
				_ = c.Close()
				t.Errorf("%v still accepts connections after Run returned", addr)
			}
		})
	}
}

// TestRejectsWhatTheDaemonWouldNot: each mistake in the arguments, the
// config or the nodes config is an error that names the argument, key, file
// (and line) at fault, and Run returns it without listening. In args, CFG
// stands for the config's path and MISSING for a file that does not exist;
// in config and want, NODES for the nodes config's path.
func TestRejectsWhatTheDaemonWouldNot(t *testing.T) {
	notHere(t)
	const good = "DAEMONIZE=0\nIMEX_NODE_CONFIG_FILE=NODES\nSERVER_PORT=0\n"
	for _, tt := range []struct {
		name   string
		args   []string
		config string
		nodes  string
		want   []string
	}{
		{name: "no -c", args: []string{}, config: good, nodes: "127.0.0.1\n", want: []string{"-c"}},
		{name: "-c without a file", args: []string{"-c"}, config: good, nodes: "127.0.0.1\n", want: []string{"-c"}},
		{name: "unknown argument", args: []string{"-c", "CFG", "--frobnicate"}, config: good, nodes: "127.0.0.1\n", want: []string{"--frobnicate"}},
		{name: "config file missing", args: []string{"-c", "MISSING"}, config: good, nodes: "127.0.0.1\n", want: []string{"MISSING"}},
		{name: "config line without =", config: good + "SERVER_PORT 50000\n", nodes: "127.0.0.1\n", want: []string{"CFG", "line 4", "SERVER_PORT 50000"}},
		{name: "DAEMONIZE=1", config: "DAEMONIZE=1\nIMEX_NODE_CONFIG_FILE=NODES\nSERVER_PORT=0\n", nodes: "127.0.0.1\n", want: []string{"DAEMONIZE=1", "DAEMONIZE=0"}},
		{name: "DAEMONIZE unset (NVIDIA's default is 1)", config: "IMEX_NODE_CONFIG_FILE=NODES\nSERVER_PORT=0\n", nodes: "127.0.0.1\n", want: []string{"DAEMONIZE", "DAEMONIZE=0"}},
		{name: "SERVER_PORT too large", config: good + "SERVER_PORT=70000\n", nodes: "127.0.0.1\n", want: []string{"SERVER_PORT", "70000"}},
		{name: "SERVER_PORT negative", config: good + "SERVER_PORT=-1\n", nodes: "127.0.0.1\n", want: []string{"SERVER_PORT", "-1"}},
		{name: "SERVER_PORT not a number", config: good + "SERVER_PORT=imex\n", nodes: "127.0.0.1\n", want: []string{"SERVER_PORT", "imex"}},
		{name: "-p too large", args: []string{"-c", "CFG", "-p", "65536"}, config: good, nodes: "127.0.0.1\n", want: []string{"-p", "65536"}},
		{name: "-p without a number", args: []string{"-c", "CFG", "-p"}, config: good, nodes: "127.0.0.1\n", want: []string{"-p"}},
		{name: "--port not a number", args: []string{"-c", "CFG", "--port=x"}, config: good, nodes: "127.0.0.1\n", want: []string{"--port", `"x"`}},
		{name: "nodes config missing", config: "DAEMONIZE=0\nIMEX_NODE_CONFIG_FILE=NODES.absent\n", nodes: "127.0.0.1\n", want: []string{"NODES.absent", "IMEX_NODE_CONFIG_FILE"}},
		{name: "nodes config defaults to NVIDIA's path", config: "DAEMONIZE=0\n", nodes: "127.0.0.1\n", want: []string{imexd.DefaultNodesConfig}},
		{name: "bad IP at line 3", config: good, nodes: "127.0.0.1\n# rack 2\n10.0.0.300\n", want: []string{"NODES", "line 3", `"10.0.0.300"`}},
		{name: "host name instead of an IP", config: good, nodes: "node-a\n", want: []string{"NODES", "line 1", `"node-a"`}},
		{name: "duplicate address", config: good, nodes: "127.0.0.1\n" + otherNode + "\n127.0.0.1\n", want: []string{"NODES", "line 3", "127.0.0.1", "line 1"}},
		{name: "no nodes", config: good, nodes: "# nobody yet\n\n", want: []string{"NODES", "no node"}},
		{name: "BIND_INTERFACE_IP not listed", config: good + "BIND_INTERFACE_IP=127.0.0.1\n", nodes: otherNode + "\n", want: []string{"BIND_INTERFACE_IP", "127.0.0.1", "NODES"}},
		{name: "BIND_INTERFACE_IP not an IP", config: good + "BIND_INTERFACE_IP=eth0\n", nodes: "127.0.0.1\n", want: []string{"BIND_INTERFACE_IP", `"eth0"`}},
		{name: "BIND_INTERFACE_IP not on this machine", config: good + "BIND_INTERFACE_IP=" + otherNode + "\n", nodes: "127.0.0.1\n" + otherNode + "\n", want: []string{"BIND_INTERFACE_IP", otherNode}},
		{name: "no local address", config: good, nodes: otherNode + "\n" + otherNode2 + "\n", want: []string{"NODES", "on this machine"}},
		{name: "port in use", config: "DAEMONIZE=0\nIMEX_NODE_CONFIG_FILE=NODES\nSERVER_PORT=" + strconv.Itoa(busyPort(t)) + "\n", nodes: "127.0.0.1\n", want: []string{"SERVER_PORT", "-p"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			configPath, nodesPath := files(t, tt.config, tt.nodes)
			missing := filepath.Join(t.TempDir(), "absent.cfg")
			args := []string{"-c", "CFG"}
			if tt.args != nil {
				args = tt.args
			}
			for i, a := range args {
				args[i] = strings.NewReplacer("CFG", configPath, "MISSING", missing).Replace(a)
			}
			// A wrong success stops at once: ready cancels, Run returns nil.
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			var out bytes.Buffer
			err := imexd.Run(ctx, args, &out, func(net.Addr) { cancel() })
			if err == nil {
				t.Fatalf("Run(%q) succeeded, want an error\n%s", args, out.String())
			}
			t.Logf("error: %v", err)
			for _, w := range tt.want {
				w = strings.NewReplacer("NODES", nodesPath, "CFG", configPath, "MISSING", missing).Replace(w)
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not name %q", err, w)
				}
			}
			if strings.Contains(out.String(), "listening") {
				t.Errorf("stdout says it listened:\n%s", out.String())
			}
		})
	}
}
