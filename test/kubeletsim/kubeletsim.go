// Package kubeletsim speaks to a DRA kubelet plugin the way the kubelet does:
// it finds the plugin through its registration socket, asks for its info,
// reports the registration status, and calls NodePrepareResources and
// NodeUnprepareResources on the plugin's DRA socket — real gRPC over real unix
// sockets, for tests and benchmarks that need a kubelet's side of the wire but
// not a kubelet.
package kubeletsim

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/apimachinery/pkg/types"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// Kubelet is a connection to one registered plugin.
type Kubelet struct {
	Info *registerapi.PluginInfo
	reg  *grpc.ClientConn
	dra  *grpc.ClientConn
	DRA  drapb.DRAPluginClient
}

// Claim names a claim as the kubelet passes it.
type Claim struct {
	Namespace, Name string
	UID             types.UID
}

// Register waits for a registration socket to appear in registrarDir (as the
// kubelet's plugin watcher does), fetches the plugin's info, connects to its
// DRA endpoint and reports successful registration.
func Register(ctx context.Context, registrarDir string) (*Kubelet, error) {
	sock, err := waitForSocket(ctx, registrarDir)
	if err != nil {
		return nil, err
	}
	return RegisterAt(ctx, sock)
}

// RegisterAt registers the plugin behind one registration socket, for a
// registration directory that holds several (a rolling update).
func RegisterAt(ctx context.Context, sock string) (*Kubelet, error) {
	reg, err := dial(sock)
	if err != nil {
		return nil, err
	}
	rc := registerapi.NewRegistrationClient(reg)
	// The socket's file exists once bound, a moment before the plugin
	// listens on it: a connection then is refused. The kubelet's plugin
	// manager tries again until the plugin answers; so does this, until
	// ctx ends.
	info, err := rc.GetInfo(ctx, &registerapi.InfoRequest{}, grpc.WaitForReady(true))
	if err != nil {
		_ = reg.Close()
		return nil, fmt.Errorf("GetInfo on %s: %w", sock, err)
	}
	if info.Type != registerapi.DRAPlugin {
		_ = reg.Close()
		return nil, fmt.Errorf("plugin type %q, want %q", info.Type, registerapi.DRAPlugin)
	}
	if !supports(info.SupportedVersions, drapb.DRAPluginService) {
		_ = reg.Close()
		return nil, fmt.Errorf("plugin offers %v, not %s", info.SupportedVersions, drapb.DRAPluginService)
	}
	dra, err := dial(info.Endpoint)
	if err != nil {
		_ = reg.Close()
		return nil, err
	}
	if _, err := rc.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: true}); err != nil {
		_ = reg.Close()
		_ = dra.Close()
		return nil, fmt.Errorf("NotifyRegistrationStatus: %w", err)
	}
	return &Kubelet{Info: info, reg: reg, dra: dra, DRA: drapb.NewDRAPluginClient(dra)}, nil
}

// Prepare calls NodePrepareResources for claims.
func (k *Kubelet) Prepare(ctx context.Context, claims ...Claim) (*drapb.NodePrepareResourcesResponse, error) {
	return k.DRA.NodePrepareResources(ctx, &drapb.NodePrepareResourcesRequest{Claims: toPB(claims)})
}

// Unprepare calls NodeUnprepareResources for claims.
func (k *Kubelet) Unprepare(ctx context.Context, claims ...Claim) (*drapb.NodeUnprepareResourcesResponse, error) {
	return k.DRA.NodeUnprepareResources(ctx, &drapb.NodeUnprepareResourcesRequest{Claims: toPB(claims)})
}

// Close drops both connections.
func (k *Kubelet) Close() error {
	err1 := k.reg.Close()
	err2 := k.dra.Close()
	if err1 != nil {
		return err1
	}
	return err2
}

func toPB(claims []Claim) []*drapb.Claim {
	out := make([]*drapb.Claim, 0, len(claims))
	for _, c := range claims {
		out = append(out, &drapb.Claim{Namespace: c.Namespace, Name: c.Name, Uid: string(c.UID)})
	}
	return out
}

func supports(versions []string, service string) bool {
	for _, v := range versions {
		if v == service {
			return true
		}
	}
	return false
}

func dial(path string) (*grpc.ClientConn, error) {
	conn, err := grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("dial %s: %w", path, err)
	}
	return conn, nil
}

func waitForSocket(ctx context.Context, dir string) (string, error) {
	for {
		entries, _ := os.ReadDir(dir)
		for _, e := range entries {
			if strings.HasSuffix(e.Name(), "-reg.sock") && e.Type()&os.ModeSocket != 0 {
				return filepath.Join(dir, e.Name()), nil
			}
		}
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("no registration socket appeared in %s: %w", dir, ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
}
