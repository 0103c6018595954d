# Tessera: a Kubernetes DRA driver for NVIDIA GPUs.
#
#   make demo    the driver on a local cluster with simulated GPU nodes
#   make test    everything CI runs: unit, allocator, socket and cluster tests
#   make lint    gofmt, go vet, staticcheck
#   make build   the binaries into _output/bin
#   make manifests  deployments/manifests/tessera.yaml from the Helm chart
#   make churn   the gang-against-small-pods race for CHURN_TRIALS trials
#   make bench   every benchmark; fails on a missed goal (docs/performance.md)
#   make bench-short  the benchmarks CI runs

SHELL := /usr/bin/env bash
GO ?= go
OUTPUT := $(CURDIR)/_output
TOOLS := $(OUTPUT)/tools
# go-nvml's cgo preamble declares functions NVML deprecated; the warnings
# are noise, not ours to fix.
export CGO_CFLAGS ?= -Wno-deprecated-declarations
# grpcnotrace leaves out gRPC's golang.org/x/net/trace. Its debug pages run
# html/template, and one reflective method call anywhere in a binary makes
# the linker keep every exported method of every type: with client-go's
# scheme that is most of the binary (the kubelet plugin links 80 MB instead
# of 49 and stays 14 MiB larger in memory). Every go command run from here
# builds with it, as the Dockerfile does (deployments/helm's
# TestBinariesAreBuiltWithoutGRPCTracing keeps the two in step).
export GOFLAGS := $(strip $(GOFLAGS) -tags=grpcnotrace)

STATICCHECK_VERSION := v0.8.2
STATICCHECK := $(TOOLS)/staticcheck-$(STATICCHECK_VERSION)

BINARIES := tessera tessera-kubelet-plugin tessera-controller tessera-webhook tessera-cdi-hook tessera-fake-imex

.PHONY: all build test oracle churn hardware-compare unit lint fmt vet staticcheck demo fuzz bench bench-short clean manifests chart-lint image image-oci

all: build

build:
	@mkdir -p $(OUTPUT)/bin
	$(GO) build -o $(OUTPUT)/bin/ $(addprefix ./cmd/,$(BINARIES))

# image builds the one image the chart runs (Dockerfile) with a container
# engine; nothing else needs one.
IMAGE ?= ghcr.io/tessera-dev/tessera:dev
CONTAINER_TOOL ?= docker
image:
	$(CONTAINER_TOOL) build -t $(IMAGE) .

# image-oci builds the same image without a container engine (test/ociimage:
# Debian packages from the cache `make cluster-bins` fills, the binaries built
# as the Dockerfile builds them) as an OCI archive, $(OUTPUT)/images/tessera.oci.tar,
# beside node-images.oci.tar (the local cluster's pause and busybox images).
# Load it with `ctr images import` or any OCI tool.
image-oci: cluster-bins
	$(GO) run ./test/cmd/ociimage -o $(OUTPUT)/images -image $(IMAGE)

include test/cluster.mk

# test runs every test, the local-cluster ones included (they need the
# control-plane binaries, built once into $(TESSERA_CACHE)), and the fuzz
# targets' seed corpora. Tests never skip: a missing prerequisite fails them.
test: cluster-bins
	$(GO) test -race -count=1 -timeout 45m ./...
	$(GO) test -race -count=1 -tags faultinject ./driver/prepare/
	$(MAKE) oracle

# oracle checks that the scheduler's allocator, over the slices Tessera
# publishes for one GPU of every MIG model, grants exactly the partition sets
# a reference model of NVIDIA's documented MIG rules allows (about 350,000
# allocator calls). It runs without the race detector: it is one goroutine,
# and the detector would make it last half an hour.
oracle:
	set -o pipefail; $(GO) test -count=1 -timeout 20m -tags oracle -run TestAllocatorAcceptsExactlyWhatTheGPUCanHold -v ./driver/slices/ | grep -E '^(---|===|ok|FAIL|PASS)|oracle_test'

# unit runs what needs no cluster binaries.
unit:
	$(GO) test -race -count=1 $$($(GO) list ./... | grep -v /test/e2e)

# fuzz runs each fuzz target briefly (CI: about 10 s each on two cores).
# The budgets are execution counts, not durations: with a duration, Go 1.26's
# fuzz coordinator can report "context deadline exceeded" when a worker is
# mid-input as time runs out (go.dev/issue/75804, fixed in Go 1.27), failing
# CI without finding anything. Longer runs: FUZZ_CHECKPOINT=5m and so on.
FUZZ_CHECKPOINT ?= 150000x
FUZZ_CDI ?= 8000x
FUZZ_CONFIG ?= 100000x
FUZZ_LDCACHE ?= 50000x
fuzz:
	$(GO) test ./driver/checkpoint -run '^$$' -fuzz FuzzDecode -fuzztime $(FUZZ_CHECKPOINT)
	$(GO) test ./cdi -run '^$$' -fuzz FuzzWriteSpec -fuzztime $(FUZZ_CDI)
	$(GO) test ./api/gpu/v1alpha1 -run '^$$' -fuzz FuzzDecode -fuzztime $(FUZZ_CONFIG)
	$(GO) test ./driver/cdihook/ldcache -run '^$$' -fuzz FuzzParse -fuzztime $(FUZZ_LDCACHE)

# bench runs every benchmark and writes the figures, each with its unit, its
# sample count and spread where it has several, and its goal, to
# $(OUTPUT)/bench.json and a table to the terminal (test/cmd/benchreport).
# Figures are ratios measured within one run or medians of several samples
# (the machines are shared and noisy). After printing every figure bench
# fails if a goal is missed, a goal was judged on fewer samples than it
# needs, or a benchmark failed (its figures null, with the reason).
# ~3 minutes on two cores, plus ~28 for the gang simulation and ~20 for the
# scheduler benchmark (docs/performance.md, "Scale").
# The plugin benchmarks (test/bench) include BenchmarkPrepareByConfiguration:
# the shipped gates against LazyMIG=false and DynamicMIG=false side by side.
# BenchmarkPublish starts the plugin PUBLISH_SAMPLES times (median, spread).
# BenchmarkGangPlacement runs on the local cluster (gang_<N>_s: gang
# creation to every member bound, and gang_<N>_vs_plain: over as many pods
# without a gang on the same cluster) for 64, 128, 256 and 512 members,
# GANG_RUNS fresh clusters each; GANG_BENCH chooses fewer sizes
# (GANG_BENCH='pods=256$$').
# BenchmarkGangScheduling simulates 32 trays with a stream of one-GPU jobs
# and gangs of 16, with and without reservations, GANGSIM_RUNS times each
# (~4.7 minutes a run; gang_wait_vs_earliest_*, gpu_utilization_*;
# docs/gang.md): its goals are judged on the median run of at least three.
GANG_BENCH ?= .
GANG_RUNS ?= 3
GANGSIM_RUNS ?= 3
PUBLISH_SAMPLES ?= 9
# BenchmarkSchedulerThroughput (~20 minutes) runs the real scheduler on 100
# and 500 simulated DGX H100 nodes for each case (whole, mig1g, migwhole,
# timeslice, memshare, and the levers lazy1g, lazywhole, aligned1g,
# alignedwhole; sched_* figures); SCHED_BENCH chooses others, one regexp per
# level: SCHED_BENCH='^nodes=1000$$/' or SCHED_BENCH='^nodes=100$$/^case=(whole|mig1g)$$'
# (the ratios need whole in the same run). SCHED_PROFILE=<dir> also writes a
# CPU profile of the scheduler per case there.
SCHED_BENCH ?= ^nodes=(100|500)$$/
SCHED_PROFILE ?=
BENCH_OUT := $(OUTPUT)/bench
# The plugin benchmarks run the binary make builds.
BENCH_PLUGIN := TESSERA_PLUGIN_BINARY=$(OUTPUT)/bin/tessera-kubelet-plugin $(GO) test -json -run '^$$' -timeout 15m ./test/bench/
BENCH_E2E := TESSERA_E2E_NO_BUILD=1 $(GO) test -json -run '^$$' ./test/e2e/
bench: cluster-bins
	@mkdir -p $(BENCH_OUT) $(OUTPUT)/bin
	$(GO) build -o $(OUTPUT)/bin/ ./cmd/tessera-kubelet-plugin
	-$(GO) test -json -run '^$$' -bench 'BenchmarkAllocator' -benchtime 2000x ./driver/slices/ > $(BENCH_OUT)/allocator.json
	-$(BENCH_PLUGIN) -bench '^BenchmarkPrepare' -benchtime 3x > $(BENCH_OUT)/plugin.json
	-$(BENCH_PLUGIN) -bench '^BenchmarkPublish$$' -benchtime $(PUBLISH_SAMPLES)x > $(BENCH_OUT)/publish.json
	-$(BENCH_E2E) -bench 'BenchmarkGangPlacement/$(GANG_BENCH)' -benchtime $(GANG_RUNS)x -timeout 45m > $(BENCH_OUT)/gang.json
	-$(BENCH_E2E) -bench 'BenchmarkGangScheduling' -benchtime $(GANGSIM_RUNS)x -timeout 60m > $(BENCH_OUT)/gangsim.json
	-TESSERA_SCHED_PROFILE=$(abspath $(SCHED_PROFILE)) $(BENCH_E2E) -bench 'BenchmarkSchedulerThroughput/$(SCHED_BENCH)' -benchtime 1x -timeout 60m > $(BENCH_OUT)/sched.json
	$(GO) run ./test/cmd/benchreport -o $(OUTPUT)/bench.json $(addprefix $(BENCH_OUT)/,allocator.json plugin.json publish.json gang.json gangsim.json sched.json)

# bench-short is the subset CI runs: the prepare latency against its floor,
# the publish time against its floor and the plugin's memory (test/bench),
# and a gang of 256 from creation to bound against as many plain pods
# (test/e2e), each judged as a ratio measured in the same run or a bound
# with room for a busy machine, on enough samples; after printing them it
# fails if one misses its goal (benchreport -short; the goals marked short
# in test/cmd/benchreport/figures.go). About 4 minutes on two cores busy
# with other work (docs/performance.md).
bench-short: cluster-bins
	@mkdir -p $(BENCH_OUT)/short $(OUTPUT)/bin
	$(GO) build -o $(OUTPUT)/bin/ ./cmd/tessera-kubelet-plugin
	-$(BENCH_PLUGIN) -bench '^BenchmarkPrepare$$' -benchtime 3x > $(BENCH_OUT)/short/prepare.json
	-$(BENCH_PLUGIN) -bench '^BenchmarkPublish$$' -benchtime $(PUBLISH_SAMPLES)x > $(BENCH_OUT)/short/publish.json
	-$(BENCH_E2E) -bench 'BenchmarkGangPlacement/pods=256$$' -benchtime $(GANG_RUNS)x -timeout 15m > $(BENCH_OUT)/short/gang.json
	$(GO) run ./test/cmd/benchreport -short -o $(OUTPUT)/bench-short.json $(addprefix $(BENCH_OUT)/short/,prepare.json publish.json gang.json)

# churn races a gang against a stream of small whole-GPU and 1g pods on one
# clique for CHURN_TRIALS trials, killing the controller at a placement step
# in turn (TestGangPlacement/AStreamOfSmallPods...; about a minute each, plus
# the cluster's start). Every trial fails on any device allocated to two
# claims at any instant. CI runs one trial within make test.
CHURN_TRIALS ?= 30
churn: cluster-bins
	set -o pipefail; TESSERA_CHURN_TRIALS=$(CHURN_TRIALS) $(GO) test -count=1 -timeout 0 -v -run 'TestGangPlacement/AStreamOfSmallPodsRacingTheGangForItsCliqueNeverLeavesHardwareHeldTwice' ./test/e2e/ 2>&1 | \
		grep -E '^\s*(---|===|ok|FAIL|PASS)|gang_stream_test|racewatch_test'

lint: fmt vet staticcheck

# hardware-compare reads this machine's real GPUs through NVML, read only
# (it changes no GPU setting, MIG mode or partition), and prints every
# difference from the simulated profile COMPARE stands for. On a machine with
# NVIDIA GPUs, commit its output as driver/gpumodel/testdata/hardware/<profile>.txt
# (its first line names the driver version and the date).
COMPARE ?= dgx-h100
hardware-compare:
	$(GO) run ./cmd/tessera inspect --compare $(COMPARE)

# manifests renders the Helm chart (deployments/helm/tessera) with Helm's Go
# code into the plain manifests; a test fails when they are stale.
manifests:
	$(GO) run ./deployments/helm/cmd/render -o deployments/manifests/tessera.yaml

# chart-lint lints, renders and checks the chart (no cluster needed); the
# apply on a real API server is TestHelmChartAppliesOnTheAPIServer in test/e2e.
chart-lint:
	$(GO) test -count=1 ./deployments/helm/

fmt:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

vet:
	$(GO) vet ./...
	$(GO) vet -tags faultinject ./driver/prepare/
	$(GO) vet -tags oracle ./driver/slices/

$(STATICCHECK):
	@mkdir -p $(TOOLS)
	GOBIN=$(TOOLS) $(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)
	mv $(TOOLS)/staticcheck $(STATICCHECK)

staticcheck: $(STATICCHECK)
	$(STATICCHECK) ./...
	$(STATICCHECK) -tags faultinject ./driver/prepare/
	$(STATICCHECK) -tags oracle ./driver/slices/

clean:
	rm -rf $(OUTPUT)
