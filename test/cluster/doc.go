// Package cluster starts a real, local Kubernetes cluster without Docker for
// end-to-end tests and demos: etcd, kube-apiserver, kube-scheduler and
// kube-controller-manager on 127.0.0.1, plus simulated nodes, each a real
// kubelet in its own mount namespace talking to an in-process fake CRI runtime
// that injects CDI devices the way containerd does and records what each
// container got.
//
// The binaries come from the cache that test/k8sbin/build.sh fills (`make
// cluster-bins`). Everything the cluster writes lives under Options.Dir; no
// host path outside it is touched. Start needs root, `unshare` and a cgroup
// file system; when something is missing it returns an error naming it.
package cluster
