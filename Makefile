# Tessera: a Kubernetes DRA driver for NVIDIA GPUs.
#
#   make demo    the driver on a local cluster with simulated GPU nodes
#   make test    everything CI runs: unit, allocator, socket and cluster tests
#   make lint    gofmt, go vet, staticcheck
#   make build   the binaries into _output/bin

SHELL := /usr/bin/env bash
GO ?= go
OUTPUT := $(CURDIR)/_output
TOOLS := $(OUTPUT)/tools
# go-nvml's cgo preamble declares functions NVML deprecated; the warnings
# are noise, not ours to fix.
export CGO_CFLAGS ?= -Wno-deprecated-declarations

STATICCHECK_VERSION := v0.8.2
STATICCHECK := $(TOOLS)/staticcheck-$(STATICCHECK_VERSION)

BINARIES := tessera tessera-kubelet-plugin

.PHONY: all build test unit lint fmt vet staticcheck demo fuzz bench clean

all: build

build:
	@mkdir -p $(OUTPUT)/bin
	$(GO) build -o $(OUTPUT)/bin/ $(addprefix ./cmd/,$(BINARIES))

include test/cluster.mk

# test runs every test, the local-cluster ones included (they need the
# control-plane binaries, built once into $(TESSERA_CACHE)), and the fuzz
# targets' seed corpora. Tests never skip: a missing prerequisite fails them.
test: cluster-bins
	$(GO) test -race -count=1 -timeout 30m ./...
	$(GO) test -race -count=1 -tags faultinject ./driver/prepare/

# unit runs what needs no cluster binaries.
unit:
	$(GO) test -race -count=1 $$($(GO) list ./... | grep -v /test/e2e)

# fuzz runs each fuzz target briefly (CI); FUZZTIME=5m for a longer run.
FUZZTIME ?= 20s
fuzz:
	$(GO) test ./driver/checkpoint -run '^$$' -fuzz FuzzDecode -fuzztime $(FUZZTIME)
	$(GO) test ./cdi -run '^$$' -fuzz FuzzWriteSpec -fuzztime $(FUZZTIME)
	$(GO) test ./api/gpu/v1alpha1 -run '^$$' -fuzz FuzzDecode -fuzztime $(FUZZTIME)

# bench runs the benchmarks; figures are ratios measured within one run
# (the machines are shared and noisy).
bench:
	$(GO) test -run '^$$' -bench . -benchtime 200x ./driver/slices/
	$(GO) test -run '^$$' -bench . -benchtime 3x ./driver/prepare/

lint: fmt vet staticcheck

fmt:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

vet:
	$(GO) vet ./...
	$(GO) vet -tags faultinject ./driver/prepare/

$(STATICCHECK):
	@mkdir -p $(TOOLS)
	GOBIN=$(TOOLS) $(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)
	mv $(TOOLS)/staticcheck $(STATICCHECK)

staticcheck: $(STATICCHECK)
	$(STATICCHECK) ./...
	$(STATICCHECK) -tags faultinject ./driver/prepare/

clean:
	rm -rf $(OUTPUT)
