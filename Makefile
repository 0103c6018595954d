# Tessera: a Kubernetes DRA driver for NVIDIA GPUs.
#
#   make demo    the driver on a local cluster with simulated GPU nodes
#   make test    everything CI runs: unit, allocator, socket and cluster tests
#   make lint    gofmt, go vet, staticcheck
#   make build   the binaries into _output/bin
#   make cli     the tessera CLI alone into _output/bin, also as kubectl-tessera
#   make install-cli  tessera and kubectl-tessera into $(BINDIR)
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

.PHONY: all build cli install-cli test oracle churn hardware-compare unit lint fmt vet staticcheck demo fuzz bench bench-short clean manifests chart-lint image image-oci

all: build

# KUBECTL_PLUGIN is the name kubectl finds the CLI by on PATH: `kubectl
# tessera ...` runs kubectl-tessera, a link to tessera, which then calls
# itself "kubectl tessera" in its usage.
KUBECTL_PLUGIN := kubectl-tessera

build:
	@mkdir -p $(OUTPUT)/bin
	$(GO) build -o $(OUTPUT)/bin/ $(addprefix ./cmd/,$(BINARIES))
	ln -sf tessera $(OUTPUT)/bin/$(KUBECTL_PLUGIN)

# cli builds the operator's CLI alone (build makes it with the others).
cli:
	@mkdir -p $(OUTPUT)/bin
	$(GO) build -o $(OUTPUT)/bin/ ./cmd/tessera
	ln -sf tessera $(OUTPUT)/bin/$(KUBECTL_PLUGIN)

# install-cli installs the CLI into BINDIR, under both names: put BINDIR on
# PATH and `kubectl tessera` works (kubectl plugin list shows it).
PREFIX ?= /usr/local
BINDIR ?= $(PREFIX)/bin
install-cli: cli
	install -d $(DESTDIR)$(BINDIR)
	install -m 0755 $(OUTPUT)/bin/tessera $(DESTDIR)$(BINDIR)/tessera
	ln -sf tessera $(DESTDIR)$(BINDIR)/$(KUBECTL_PLUGIN)

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
#
# Its parts run in two lanes (make -j2, -k: every part runs whatever another
# did): the e2e package (test/e2e), which mostly waits on its clusters'
# timers, in one; the other packages, the faultinject pass and the oracle,
# one after another, in the other, at a lower CPU priority (nice -n 10) so
# that the clusters' control planes are never starved into timeouts. On a
# fresh machine the e2e lane first builds the cluster binaries while the
# other lane tests. Each part keeps its go test -json events in
# $(TEST_OUT)/<part>.json and prints its report whole when it ends (make -O):
# packages, every failed test's output under its full subtest name, counts.
# test then ends with the tables of the slowest packages, tests and subtests
# of all parts (test/cmd/testreport). TEST_ALSO names other targets to run in
# the second lane (.ci/run: lint fuzz); make test-e2e, test-unit,
# test-faultinject and oracle run one part alone.
TEST_OUT := $(OUTPUT)/test
TEST_PARTS := e2e unit faultinject oracle
TEST_ALSO ?=
TESTREPORT := $(GO) run ./test/cmd/testreport
# NICE prefixes the commands of the parts that run beside the e2e package.
NICE ?=
test:
	@rm -rf $(TEST_OUT) && mkdir -p $(TEST_OUT)
	@start=$$(date +%s); rc=0; \
	$(MAKE) --no-print-directory -k -j2 --output-sync=target NICE='nice -n 10' \
		test-e2e $(TEST_ALSO) test-unit test-faultinject oracle || rc=$$?; \
	for part in $(TEST_PARTS); do \
		[ -s $(TEST_OUT)/$$part.json ] || { echo "make test: the $$part part did not run"; rc=1; }; \
	done; \
	$(TESTREPORT) -brief -slowest 10 $(TEST_OUT)/*.json || rc=1; \
	echo "make test: $$([ $$rc = 0 ] && echo ok || echo FAILED) in $$(( $$(date +%s) - start ))s (go test -json events: $(TEST_OUT))"; \
	exit $$rc

# timed runs the shell command $(2) as the step $(1) and ends its output with
# the step's status and duration.
define timed
start=$$(date +%s); rc=0; ( $(2) ) || rc=$$?; \
echo "== $(1): $$([ $$rc = 0 ] && echo ok || echo "FAILED (exit $$rc)") in $$(( $$(date +%s) - start ))s"; exit $$rc
endef

# part runs the go test -json command $(2) as the part $(1) of make test: its
# events into $(TEST_OUT)/$(1).json, then testreport's account of them
# (flags $(3)). It fails when either fails.
define part
mkdir -p $(TEST_OUT); $(call timed,$(1),rc=0; $(2) > $(TEST_OUT)/$(1).json || rc=$$?; $(TESTREPORT) $(3) $(TEST_OUT)/$(1).json || rc=1; exit $$rc)
endef

# The parts have no prerequisites: make -j starts a target whose
# prerequisites are still being made only after the goals listed after it,
# which would put the e2e package, the longest part, last. So test-e2e makes
# cluster-bins in its own recipe; its clusters run the binaries that built,
# and its TestMain need not run test/k8sbin/build.sh again. E2E_FLAGS adds
# go test flags (E2E_FLAGS='-run Smoke').
.PHONY: test-e2e test-unit test-faultinject
E2E_FLAGS ?=
test-e2e:
	@$(MAKE) --no-print-directory cluster-bins
	@$(call part,e2e,TESSERA_E2E_NO_BUILD=1 $(GO) test -race -count=1 -json -timeout 45m $(E2E_FLAGS) ./test/e2e/)

# unit runs what needs no cluster binaries.
UNIT_PACKAGES = $(shell $(GO) list ./... | grep -v '/test/e2e$$')
unit: test-unit
test-unit:
	@$(call part,unit,$(NICE) $(GO) test -race -count=1 -json -timeout 45m $(UNIT_PACKAGES))

test-faultinject:
	@$(call part,faultinject,$(NICE) $(GO) test -race -count=1 -json -tags faultinject ./driver/prepare/)

# oracle checks that the scheduler's allocator, over the slices Tessera
# publishes for one GPU of every MIG model, grants exactly the partition sets
# a reference model of NVIDIA's documented MIG rules allows (about 350,000
# allocator calls). It runs without the race detector: it is one goroutine,
# and the detector would make it last half an hour.
oracle:
	@$(call part,oracle,$(NICE) $(GO) test -count=1 -json -timeout 20m -tags oracle -run TestAllocatorAcceptsExactlyWhatTheGPUCanHold ./driver/slices/,-v)

# fuzz runs each fuzz target briefly (CI: about 10 s each on two cores).
# The budgets are execution counts, not durations: with a duration, Go 1.26's
# fuzz coordinator can report "context deadline exceeded" when a worker is
# mid-input as time runs out (go.dev/issue/75804, fixed in Go 1.27), failing
# CI without finding anything. Longer runs: FUZZ_CHECKPOINT=5m and so on.
FUZZ_CHECKPOINT ?= 150000x
FUZZ_CDI ?= 8000x
FUZZ_CONFIG ?= 100000x
FUZZ_LDCACHE ?= 50000x
FUZZ_TARGETS = ./driver/checkpoint:FuzzDecode:$(FUZZ_CHECKPOINT) ./cdi:FuzzWriteSpec:$(FUZZ_CDI) \
	./api/gpu/v1alpha1:FuzzDecode:$(FUZZ_CONFIG) ./driver/cdihook/ldcache:FuzzParse:$(FUZZ_LDCACHE)
fuzz:
	@$(call timed,fuzz,for t in $(FUZZ_TARGETS); do \
		IFS=: read -r pkg target budget <<< "$$t"; \
		echo "$(GO) test $$pkg -run '^$$' -fuzz $$target -fuzztime $$budget"; \
		$(NICE) $(GO) test $$pkg -run '^$$' -fuzz $$target -fuzztime $$budget || exit; \
	done)

# bench runs every benchmark and writes the figures, each with its unit, its
# sample count and spread where it has several, and its goal, to
# $(OUTPUT)/bench.json and a table to the terminal (test/cmd/benchreport).
# Figures are ratios measured within one run or medians of several samples
# (the machines are shared and noisy). After printing every figure bench
# fails if a goal is missed, a goal was judged on fewer samples than it
# needs, or a benchmark failed (its figures null, with the reason).
# About an hour on two cores: ~3 minutes for the plugin and allocator
# benchmarks, ~8 for the gang placements, ~28 for the gang simulation and
# ~20 for the scheduler benchmark (docs/performance.md, "Running the
# benchmarks").
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

lint:
	@$(call timed,lint,$(MAKE) --no-print-directory fmt vet staticcheck)

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
	$(NICE) $(GO) vet ./...
	$(NICE) $(GO) vet -tags faultinject ./driver/prepare/
	$(NICE) $(GO) vet -tags oracle ./driver/slices/

$(STATICCHECK):
	@mkdir -p $(TOOLS)
	GOBIN=$(TOOLS) $(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)
	mv $(TOOLS)/staticcheck $(STATICCHECK)

staticcheck: $(STATICCHECK)
	$(NICE) $(STATICCHECK) ./...
	$(NICE) $(STATICCHECK) -tags faultinject ./driver/prepare/
	$(NICE) $(STATICCHECK) -tags oracle ./driver/slices/

clean:
	rm -rf $(OUTPUT)
