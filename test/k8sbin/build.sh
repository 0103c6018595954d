#!/usr/bin/env bash
# build.sh builds the Kubernetes and etcd binaries that test/cluster runs, from
# the Go module proxy only, into a cache outside the repository:
#
#   ${TESSERA_CACHE:-$HOME/.cache/tessera}/bin/k8s-<version>/   kube-apiserver kube-scheduler
#                                                                kube-controller-manager kubelet
#   ${TESSERA_CACHE:-$HOME/.cache/tessera}/bin/etcd-<version>/  etcd
#
# The versions come from test/k8sbin/go.mod and test/k8sbin/etcd/go.mod, so a
# version bump builds into a new directory. A directory is complete when its
# .stamp file exists; the stamp is written only after every binary built. Runs
# that find a complete directory do nothing, so the script is safe to run often.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache="${TESSERA_CACHE:-$HOME/.cache/tessera}/bin"
# GOFLAGS is not inherited: Tessera's build tags (Makefile) are not upstream's.
export GOWORK=off GOFLAGS="-mod=readonly" CGO_ENABLED=0

log() { printf 'k8sbin: %s\n' "$*" >&2; }

module_version() { # module_version <module dir> <module path>
	(cd "$1" && go list -m -f '{{.Version}}' "$2")
}

# build_set <module dir> <target dir> <ldflags> <name=package:minutes>...
build_set() {
	local moddir="$1" dir="$2" ldflags="$3"
	shift 3
	if [[ -f "$dir/.stamp" ]]; then
		log "up to date: $dir"
		return
	fi
	mkdir -p "$dir"
	local entry name pkg minutes start
	for entry in "$@"; do
		name="${entry%%=*}"
		pkg="${entry#*=}"
		minutes="${pkg##*:}"
		pkg="${pkg%:*}"
		if [[ -x "$dir/$name" ]]; then
			log "already built: $dir/$name"
			continue
		fi
		log "building $name (cold build takes ~$minutes min on 2 idle cores, seconds with a warm Go build cache)..."
		start=$SECONDS
		(cd "$moddir" && go build -ldflags "$ldflags" -o "$dir/$name.tmp" "$pkg")
		mv "$dir/$name.tmp" "$dir/$name"
		log "built $name in $((SECONDS - start))s"
	done
	go version >"$dir/.stamp.tmp"
	mv "$dir/.stamp.tmp" "$dir/.stamp"
	log "done: $dir"
}

mkdir -p "$cache"
if command -v flock >/dev/null; then
	exec 9>"$cache/.lock"
	if ! flock -n 9; then
		log "another build holds $cache/.lock; waiting..."
		flock 9
	fi
fi

k8s_version="$(module_version "$here" k8s.io/kubernetes)"
etcd_version="$(module_version "$here/etcd" go.etcd.io/etcd/server/v3)"
k8s_minor="${k8s_version#v*.}"
k8s_minor="${k8s_minor%%.*}"
k8s_ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
	k8s_ldflags+=" -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$k8s_minor"
	k8s_ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

build_set "$here" "$cache/k8s-$k8s_version" "$k8s_ldflags" \
	kube-apiserver=k8s.io/kubernetes/cmd/kube-apiserver:6 \
	kube-controller-manager=k8s.io/kubernetes/cmd/kube-controller-manager:2 \
	kube-scheduler=k8s.io/kubernetes/cmd/kube-scheduler:1 \
	kubelet=k8s.io/kubernetes/cmd/kubelet:3
build_set "$here/etcd" "$cache/etcd-$etcd_version" "-s -w" \
	etcd=go.etcd.io/etcd/server/v3:2
