// Package mps runs NVIDIA MPS control daemons for claims that share their
// GPUs through MPS: one daemon per claim, as a pod on the plugin's node.
//
// Why a pod and not a child process: the plugin runs no host binaries
// (docs/guarantees.md), and a pod is supervised by the kubelet (restarted
// when it crashes), visible with kubectl, and accounted like any workload.
// The daemon binary comes from the host's driver root, mounted read-only,
// so the image needs no NVIDIA files of its own.
//
// The contract, relied on by the prepare state machine:
//   - Locate is a pure function of the claim UID, so the daemon's pod and
//     directory are checkpointed before anything exists.
//   - Start and Stop are idempotent: a retried prepare finds the pod
//     running; a retried unprepare finds it gone.
//   - Every daemon pod carries the node and claim UID as labels, so the
//     daemon sweep (Claims, then prepare's StopOrphanDaemon) can delete
//     daemons whose claims the node no longer holds (a lost checkpoint, a
//     crash while the API was unreachable).
package mps

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"

	"github.com/tessera-dev/tessera/cdi"
	"github.com/tessera-dev/tessera/driver/checkpoint"
	"github.com/tessera-dev/tessera/driver/daemonpod"
	"github.com/tessera-dev/tessera/driver/prepare"
)

// Labels on every daemon pod.
const (
	LabelApp      = daemonpod.LabelApp
	AppName       = "tessera-mps"
	LabelNode     = daemonpod.LabelNode
	LabelClaimUID = daemonpod.LabelClaimUID
)

// Where clients and the daemon see the daemon's directories.
const (
	PipeDir = "/tmp/nvidia-mps"
	LogDir  = "/var/log/nvidia-mps"
	// driverRootMount is where the daemon sees the host's driver root.
	driverRootMount = daemonpod.DriverRootMount
)

// Daemons runs daemon pods on one node; Host.Dir holds each daemon's pipe,
// log and shared-memory directories, one subdirectory per claim.
type Daemons struct {
	daemonpod.Host
}

var _ prepare.MPSDaemons = (*Daemons)(nil)

// Locate names a claim's daemon pod and directory.
func (d *Daemons) Locate(claimUID string) checkpoint.MPSDaemon {
	return checkpoint.MPSDaemon{Pod: "tessera-mps-" + claimUID, Dir: filepath.Join(d.Dir, claimUID)}
}

// Start runs the claim's daemon and waits until its container runs.
func (d *Daemons) Start(ctx context.Context, daemon prepare.MPSDaemon) (cdi.Edits, error) {
	if !d.Runs() {
		return cdi.Edits{}, fmt.Errorf("MPS daemon %s: the plugin runs without an MPS daemon image (--mps-image)", daemon.Pod)
	}
	for _, sub := range []string{"pipe", "log", "shm"} {
		if err := os.MkdirAll(filepath.Join(daemon.Dir, sub), 0o755); err != nil {
			return cdi.Edits{}, fmt.Errorf("MPS directories: %w", err)
		}
	}
	pod := d.Pod(daemon)
	if err := d.Ensure(ctx, pod, nil, "MPS daemon"); err != nil {
		return cdi.Edits{}, err
	}
	if err := daemonpod.Wait(ctx, d.Client, d.Namespace, pod.Name, daemonpod.Running, d.ReadyTimeout, "MPS daemon", "check the pod's events and --mps-image"); err != nil {
		return cdi.Edits{}, err
	}
	klog.FromContext(ctx).V(2).Info("MPS control daemon running", "pod", klog.KRef(d.Namespace, pod.Name), "claim", klog.KRef(daemon.ClaimNamespace, daemon.ClaimName), "devices", daemon.Devices)
	return cdi.Edits{
		Env: append([]string{"CUDA_MPS_PIPE_DIRECTORY=" + PipeDir, "CUDA_MPS_LOG_DIRECTORY=" + LogDir}, daemon.Env...),
		Mounts: []cdi.Mount{
			{HostPath: filepath.Join(daemon.Dir, "pipe"), ContainerPath: PipeDir},
			{HostPath: filepath.Join(daemon.Dir, "log"), ContainerPath: LogDir},
			// Clients and the server exchange memory through /dev/shm.
			{HostPath: filepath.Join(daemon.Dir, "shm"), ContainerPath: "/dev/shm"},
		},
	}, nil
}

// Pod is the daemon's pod: pinned to this node, restarted when it exits,
// tolerating every taint (it serves pods already admitted here). It is the
// only pod the chart's MPS-lock admission policy lets the plugin's token
// create (deployments/rbac/mps-lock.yaml): this node, the MPS image, the
// daemon's command and environment, the default service account without a
// token, no host namespaces, and host directories limited to the claim's
// pipe, log and shm directories under Dir and the driver root read-only.
// Change both together (TestHelmChartAppliesOnTheAPIServer creates this pod
// with a node's token).
func (d *Daemons) Pod(daemon prepare.MPSDaemon) *corev1.Pod {
	env := []corev1.EnvVar{
		{Name: "CUDA_VISIBLE_DEVICES", Value: strings.Join(daemon.Devices, ",")},
		{Name: "CUDA_MPS_PIPE_DIRECTORY", Value: PipeDir},
		{Name: "CUDA_MPS_LOG_DIRECTORY", Value: LogDir},
		{Name: "LD_LIBRARY_PATH", Value: daemonpod.LibraryPath()},
	}
	for _, kv := range daemon.Env {
		k, v, _ := strings.Cut(kv, "=")
		env = append(env, corev1.EnvVar{Name: k, Value: v})
	}
	return d.Host.Pod(daemon.Pod, AppName, daemon.ClaimUID, daemon.ClaimNamespace+"/"+daemon.ClaimName, corev1.Container{
		Name:    "mps-control-daemon",
		Command: []string{driverRootMount + "/usr/bin/nvidia-cuda-mps-control", "-f"},
		Env:     env,
		VolumeMounts: []corev1.VolumeMount{
			{Name: "pipe", MountPath: PipeDir},
			{Name: "log", MountPath: LogDir},
			{Name: "shm", MountPath: "/dev/shm"},
			{Name: "driver-root", MountPath: driverRootMount, ReadOnly: true},
		},
	},
		daemonpod.HostDirectory("pipe", filepath.Join(daemon.Dir, "pipe")),
		daemonpod.HostDirectory("log", filepath.Join(daemon.Dir, "log")),
		daemonpod.HostDirectory("shm", filepath.Join(daemon.Dir, "shm")),
		daemonpod.HostDirectory("driver-root", d.DriverRoot),
	)
}

// Stop deletes the daemon's pod and directory.
func (d *Daemons) Stop(ctx context.Context, daemon checkpoint.MPSDaemon) error {
	// Until it is gone: a claim prepared again meanwhile must not find
	// the old pod on its way out and take it for its daemon.
	return d.Host.Stop(ctx, daemon, true, "MPS daemon")
}

// Claims lists the claim UIDs of this node's daemons, for the daemon sweep
// to stop those of claims the node does not hold
// (prepare.Manager.StopOrphanDaemon).
func (d *Daemons) Claims(ctx context.Context) ([]string, error) {
	return d.Host.Claims(ctx, AppName)
}
