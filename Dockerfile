# One image holds every Tessera binary; the chart runs each from it
# (deployments/helm: TestImageHoldsEveryBinaryTheChartRuns keeps the two in
# step). Build: `make image` (IMAGE=..., CONTAINER_TOOL=docker|podman).
#
# NVML is not in the image: go-nvml loads libnvidia-ml.so.1 at run time from
# the node's driver root (--driver-root), so one image serves every driver
# version. The base has glibc for it (and for the MPS control daemon the
# plugin runs from the driver root in this image). tessera-cdi-hook, the CDI
# specs' createContainer hook, is copied onto each node by the kubelet
# plugin's init container: the container runtime runs it on the host.
# tessera-fake-imex is the simulated driver's nvidia-imex: a fake node's
# driver root links usr/bin/nvidia-imex to it, which resolves here, in the
# IMEX daemon pods the plugin runs from this image on simulated nodes.
ARG GO_VERSION=1.26
FROM golang:${GO_VERSION} AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=dev
# go-nvml needs cgo; its headers use deprecated declarations on purpose.
# grpcnotrace: see the Makefile (the binaries are a third smaller without it).
RUN CGO_ENABLED=1 CGO_CFLAGS=-Wno-deprecated-declarations \
    go build -tags=grpcnotrace -trimpath -ldflags="-s -w" -o /out/ \
    ./cmd/tessera ./cmd/tessera-kubelet-plugin ./cmd/tessera-controller ./cmd/tessera-webhook \
    ./cmd/tessera-cdi-hook ./cmd/tessera-fake-imex

FROM gcr.io/distroless/base-debian12
LABEL org.opencontainers.image.source="https://github.com/tessera-dev/tessera" \
      org.opencontainers.image.description="Tessera: a Kubernetes DRA driver for NVIDIA GPUs"
COPY --from=build /out/ /usr/local/bin/
ENTRYPOINT ["/usr/local/bin/tessera-kubelet-plugin"]
