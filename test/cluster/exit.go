package cluster

import (
	"context"
	"fmt"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// ExitContainer makes the running container name of the pod podUID exit
// with code, as a crashing process would; the kubelet notices at its next
// relist (about a second).
func (n *Node) ExitContainer(podUID, name string, code int32) error {
	if n.runtime == nil {
		return fmt.Errorf("node %s: only a fake runtime's containers can be made to exit", n.name)
	}
	rs := n.runtime.RuntimeService
	rs.Lock()
	defer rs.Unlock()
	for _, c := range rs.Containers {
		if c.Labels["io.kubernetes.pod.uid"] == podUID && c.Metadata.GetName() == name && c.State == runtimeapi.ContainerState_CONTAINER_RUNNING {
			c.State = runtimeapi.ContainerState_CONTAINER_EXITED
			c.ExitCode = code
			c.Reason = "Error"
			c.FinishedAt = time.Now().UnixNano()
			return nil
		}
	}
	return fmt.Errorf("node %s: no running container %q of pod %s", n.name, name, podUID)
}

// sigtermExit is how a process without a SIGTERM handler ends when the
// kubelet stops its container: 128+15.
const sigtermExit = 143

// StopContainer stops the container as the fake does, but reports it killed
// by SIGTERM, as a real runtime does for most processes: the fake's exit
// code 0 would make every stopped pod Succeeded (so a Job counts an evicted
// member's index as complete).
func (r *criRuntime) StopContainer(ctx context.Context, req *runtimeapi.StopContainerRequest) (*runtimeapi.StopContainerResponse, error) {
	rs := r.RuntimeService
	rs.Lock()
	c, ok := rs.Containers[req.ContainerId]
	wasRunning := ok && c.State == runtimeapi.ContainerState_CONTAINER_RUNNING
	rs.Unlock()
	resp, err := r.RemoteRuntime.StopContainer(ctx, req)
	if err != nil || !wasRunning {
		return resp, err
	}
	rs.Lock()
	if c, ok := rs.Containers[req.ContainerId]; ok {
		c.ExitCode, c.Reason = sigtermExit, "Error"
	}
	rs.Unlock()
	return resp, nil
}
