package cluster

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	"k8s.io/cri-client/pkg/fake"
	"k8s.io/cri-client/pkg/util"
	"k8s.io/klog/v2"
	"tags.cncf.io/container-device-interface/pkg/cdi"
)

// RecordedContainer is what the fake runtime was asked to create, after CDI
// injection: what a real runtime would have handed to runc.
type RecordedContainer struct {
	ID           string
	PodNamespace string
	PodName      string
	PodUID       string
	Name         string // the container's name in the pod
	// CDIDevices are the fully qualified CDI device names the kubelet
	// passed, from ContainerConfig.CDIDevices and cdi.k8s.io/ annotations.
	CDIDevices []string
	// Spec is the OCI spec with the devices injected: device nodes in
	// Spec.Linux.Devices, environment in Spec.Process.Env, mounts in
	// Spec.Mounts.
	Spec *specs.Spec
}

// criRuntime is one node's fake CRI runtime: k8s.io/cri-client/pkg/fake (as
// kubemark's hollow node uses it) with CreateContainer wrapped to inject CDI
// devices like containerd does and to record the result.
type criRuntime struct {
	*fake.RemoteRuntime
	server *grpc.Server
	cache  *cdi.Cache
	logger klog.Logger
	// varLogDir is the host directory the kubelet sees as /var/log.
	varLogDir string

	mu         sync.Mutex
	containers []RecordedContainer
}

// startRuntime serves a fake runtime on the unix socket at socketPath that
// resolves CDI devices from the specs in cdiDir. varLogDir is the host
// directory mounted over the kubelet's /var/log, where container logs go.
func startRuntime(ctx context.Context, socketPath, cdiDir, varLogDir string) (*criRuntime, error) {
	cache, err := cdi.NewCache(cdi.WithSpecDirs(cdiDir), cdi.WithAutoRefresh(false))
	if err != nil {
		return nil, fmt.Errorf("create CDI cache over %s: %w", cdiDir, err)
	}
	r := &criRuntime{
		RemoteRuntime: fake.NewFakeRemoteRuntime(),
		server:        grpc.NewServer(),
		cache:         cache,
		varLogDir:     varLogDir,
		logger:        klog.FromContext(ctx).WithValues("runtime", socketPath),
	}
	r.RuntimeService.FakeStatus = &runtimeapi.RuntimeStatus{Conditions: []*runtimeapi.RuntimeCondition{
		{Type: runtimeapi.RuntimeReady, Status: true},
		{Type: runtimeapi.NetworkReady, Status: true},
	}}
	r.RuntimeService.FakeLinuxConfiguration = &runtimeapi.LinuxRuntimeConfiguration{
		CgroupDriver: runtimeapi.CgroupDriver_CGROUPFS,
	}
	// The kubelet treats a zero-sized image as not pulled.
	r.ImageService.SetFakeImageSize(100 << 20)
	runtimeapi.RegisterRuntimeServiceServer(r.server, r)
	runtimeapi.RegisterImageServiceServer(r.server, r)

	l, err := util.CreateListener("unix://" + socketPath)
	if err != nil {
		return nil, fmt.Errorf("listen for the fake runtime on %s: %w", socketPath, err)
	}
	go func() { _ = r.server.Serve(l) }()
	return r, nil
}

func (r *criRuntime) stop() {
	if r != nil {
		r.server.Stop()
	}
}

// Status reports the runtime ready. It also drops the fakes' call logs,
// which would otherwise grow with every poll of the kubelet.
func (r *criRuntime) Status(ctx context.Context, req *runtimeapi.StatusRequest) (*runtimeapi.StatusResponse, error) {
	r.RuntimeService.Lock()
	r.RuntimeService.Called = r.RuntimeService.Called[:0]
	r.RuntimeService.Unlock()
	r.ImageService.Lock()
	r.ImageService.Called = r.ImageService.Called[:0]
	r.ImageService.Unlock()
	return r.RemoteRuntime.Status(ctx, req)
}

// CreateContainer injects the container's CDI devices into an OCI spec built
// from its config and records it. As in containerd, a device that cannot be
// injected fails the call.
func (r *criRuntime) CreateContainer(ctx context.Context, req *runtimeapi.CreateContainerRequest) (*runtimeapi.CreateContainerResponse, error) {
	config := req.GetConfig()
	spec := baseSpec(config)
	devices, err := cdiDevices(config)
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "CDI device injection failed: %v", err)
	}
	if len(devices) > 0 {
		if err := r.cache.Refresh(); err != nil {
			// containerd logs spec errors and carries on; a device from a
			// broken spec then fails to resolve below.
			r.logger.Info("CDI cache refresh reported errors", "err", err)
		}
		if _, err := r.cache.InjectDevices(spec, devices...); err != nil {
			r.logger.Info("CDI injection failed", "container", config.GetMetadata().GetName(), "devices", devices, "err", err)
			return nil, status.Errorf(codes.Unknown, "CDI device injection failed: %v", err)
		}
	}
	resp, err := r.RemoteRuntime.CreateContainer(ctx, req)
	if err != nil {
		return nil, err
	}
	if err := r.createLog(resp.GetContainerId(), req); err != nil {
		return nil, err
	}
	labels := config.GetLabels()
	r.mu.Lock()
	r.containers = append(r.containers, RecordedContainer{
		ID:           resp.GetContainerId(),
		PodNamespace: labels["io.kubernetes.pod.namespace"],
		PodName:      labels["io.kubernetes.pod.name"],
		PodUID:       labels["io.kubernetes.pod.uid"],
		Name:         config.GetMetadata().GetName(),
		CDIDevices:   devices,
		Spec:         spec,
	})
	r.mu.Unlock()
	return resp, nil
}

// createLog gives the container an empty log file where the kubelet expects
// it, and reports its path in the container's status as real runtimes do.
// Without a log path the kubelet, when it removes the container, deletes
// the files matching "*" in its working directory.
func (r *criRuntime) createLog(id string, req *runtimeapi.CreateContainerRequest) error {
	dir, name := req.GetSandboxConfig().GetLogDirectory(), req.GetConfig().GetLogPath()
	if dir == "" || name == "" {
		return nil
	}
	logPath := filepath.Join(dir, name)
	rel, err := filepath.Rel("/var/log", logPath)
	if err != nil || strings.HasPrefix(rel, "..") {
		return status.Errorf(codes.InvalidArgument, "container log %s is outside /var/log, which the fake runtime cannot reach", logPath)
	}
	hostPath := filepath.Join(r.varLogDir, rel)
	if err := os.MkdirAll(filepath.Dir(hostPath), 0o750); err != nil {
		return status.Errorf(codes.Internal, "create container log dir: %v", err)
	}
	if err := os.WriteFile(hostPath, nil, 0o640); err != nil {
		return status.Errorf(codes.Internal, "create container log: %v", err)
	}
	r.RuntimeService.Lock()
	defer r.RuntimeService.Unlock()
	if c, ok := r.RuntimeService.Containers[id]; ok {
		c.LogPath = logPath
	}
	return nil
}

// recorded returns a copy of the containers created so far, oldest first.
func (r *criRuntime) recorded() []RecordedContainer {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]RecordedContainer(nil), r.containers...)
}

// dropAll forgets every pod sandbox and container, and what was recorded.
func (r *criRuntime) dropAll() {
	r.RuntimeService.Lock()
	clear(r.RuntimeService.Sandboxes)
	clear(r.RuntimeService.Containers)
	clear(r.RuntimeService.FakeContainerStats)
	clear(r.RuntimeService.FakePodSandboxStats)
	r.RuntimeService.Unlock()
	r.mu.Lock()
	r.containers = nil
	r.mu.Unlock()
}

// cdiDevices collects the qualified CDI device names of a container, from the
// CRI field and the cdi.k8s.io/ annotations, without duplicates.
func cdiDevices(config *runtimeapi.ContainerConfig) ([]string, error) {
	_, fromAnnotations, err := cdi.ParseAnnotations(config.GetAnnotations())
	if err != nil {
		return nil, fmt.Errorf("parse CDI annotations: %w", err)
	}
	sort.Strings(fromAnnotations) // annotations come from a map
	seen := map[string]bool{}
	var devices []string
	for _, d := range config.GetCDIDevices() {
		if !seen[d.GetName()] {
			seen[d.GetName()] = true
			devices = append(devices, d.GetName())
		}
	}
	for _, name := range fromAnnotations {
		if !seen[name] {
			seen[name] = true
			devices = append(devices, name)
		}
	}
	return devices, nil
}

// baseSpec is the part of the OCI spec a runtime derives from the CRI
// container config before CDI edits: process, environment and mounts.
func baseSpec(config *runtimeapi.ContainerConfig) *specs.Spec {
	spec := &specs.Spec{
		Version: specs.Version,
		Process: &specs.Process{
			Args: append(append([]string{}, config.GetCommand()...), config.GetArgs()...),
			Cwd:  "/",
			Env:  []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
		},
		Root:        &specs.Root{Path: "rootfs"},
		Hostname:    config.GetMetadata().GetName(),
		Annotations: config.GetAnnotations(),
		Linux:       &specs.Linux{Resources: &specs.LinuxResources{}},
	}
	if wd := config.GetWorkingDir(); wd != "" {
		spec.Process.Cwd = wd
	}
	for _, kv := range config.GetEnvs() {
		spec.Process.Env = append(spec.Process.Env, kv.GetKey()+"="+string(kv.GetValue()))
	}
	for _, m := range config.GetMounts() {
		options := []string{"rbind"}
		if m.GetReadonly() {
			options = append(options, "ro")
		} else {
			options = append(options, "rw")
		}
		spec.Mounts = append(spec.Mounts, specs.Mount{
			Destination: m.GetContainerPath(),
			Source:      m.GetHostPath(),
			Type:        "bind",
			Options:     options,
		})
	}
	for _, d := range config.GetDevices() {
		spec.Linux.Devices = append(spec.Linux.Devices, specs.LinuxDevice{Path: d.GetContainerPath()})
	}
	return spec
}

// EnvMap returns the container's environment as a map.
func (rc RecordedContainer) EnvMap() map[string]string {
	env := map[string]string{}
	for _, kv := range rc.Spec.Process.Env {
		k, v, _ := strings.Cut(kv, "=")
		env[k] = v
	}
	return env
}
