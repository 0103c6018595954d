# Targets for the local test cluster (test/cluster). Included from the
# top-level Makefile.

TESSERA_CACHE ?= $(HOME)/.cache/tessera
export TESSERA_CACHE

.PHONY: cluster-bins e2e-smoke

# Build kube-apiserver, kube-scheduler, kube-controller-manager, kubelet,
# etcd, containerd and the CNI plugins from the Go module proxy into
# $(TESSERA_CACHE)/bin, install Debian's runc when missing, and download the
# Debian packages of the images (test/ociimage) into $(TESSERA_CACHE)/debs
# (cold: ~20 min on two cores; afterwards a no-op).
cluster-bins:
	test/k8sbin/build.sh

# Start a one-node local cluster and check scheduling and DRA allocation.
e2e-smoke: cluster-bins
	TESSERA_E2E_NO_BUILD=1 go test ./test/e2e/ -run Smoke -v -count=1

# Run a local cluster until Ctrl-C (NODES=gpu-node-1,gpu-node-2 for more).
NODES ?= gpu-node-1
.PHONY: cluster-up
cluster-up: cluster-bins
	go run ./test/cmd/localcluster --nodes $(NODES)

# Tessera end to end on a two-node local cluster (a simulated DGX H100 and a
# PCIe server with four L4s): installs the DeviceClasses and RBAC, runs the
# kubelet plugin per node, applies deployments/examples and prints where each
# workload landed and what its container got; then tears everything down.
# DEMO_FLAGS=--keep keeps the cluster dir and its logs.
.PHONY: demo
demo: cluster-bins
	go run ./test/cmd/demo $(DEMO_FLAGS)
