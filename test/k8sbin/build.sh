#!/usr/bin/env bash
# build.sh builds the Kubernetes and etcd binaries that test/cluster runs, from
# the Go module proxy only, into a cache outside the repository:
#
#   ${TESSERA_CACHE:-$HOME/.cache/tessera}/bin/k8s-<version>/   kube-apiserver kube-scheduler
#                                                                kube-controller-manager kubelet
#   ${TESSERA_CACHE:-$HOME/.cache/tessera}/bin/etcd-<version>/  etcd
#   ${TESSERA_CACHE:-$HOME/.cache/tessera}/bin/containerd-<version>/  containerd
#                                                                containerd-shim-runc-v2 ctr
#   ${TESSERA_CACHE:-$HOME/.cache/tessera}/bin/cni-<version>/   bridge host-local loopback
#
# The versions come from the go.mod files of test/k8sbin and its etcd,
# containerd and cni modules, so a version bump builds into a new directory. A directory is complete when its
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

# build_set <module dir> <target dir> <ldflags> <tags> <name=package:minutes>...
build_set() {
	local moddir="$1" dir="$2" ldflags="$3" tags="$4"
	shift 4
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
		(cd "$moddir" && go build -tags "$tags" -ldflags "$ldflags" -o "$dir/$name.tmp" "$pkg")
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

build_set "$here" "$cache/k8s-$k8s_version" "$k8s_ldflags" "" \
	kube-apiserver=k8s.io/kubernetes/cmd/kube-apiserver:6 \
	kube-controller-manager=k8s.io/kubernetes/cmd/kube-controller-manager:2 \
	kube-scheduler=k8s.io/kubernetes/cmd/kube-scheduler:1 \
	kubelet=k8s.io/kubernetes/cmd/kubelet:3
build_set "$here/etcd" "$cache/etcd-$etcd_version" "-s -w" "" \
	etcd=go.etcd.io/etcd/server/v3:2

# containerd and the CNI plugins run the real-runtime nodes (test/cluster's
# RealContainerd). no_btrfs: the btrfs snapshotter needs cgo and headers;
# the nodes use overlayfs.
containerd_version="$(module_version "$here/containerd" github.com/containerd/containerd/v2)"
build_set "$here/containerd" "$cache/containerd-$containerd_version" \
	"-s -w -X github.com/containerd/containerd/v2/version.Version=$containerd_version" no_btrfs \
	containerd=github.com/containerd/containerd/v2/cmd/containerd:3 \
	containerd-shim-runc-v2=github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2:1 \
	ctr=github.com/containerd/containerd/v2/cmd/ctr:1
cni_version="$(module_version "$here/cni" github.com/containernetworking/plugins)"
build_set "$here/cni" "$cache/cni-$cni_version" "-s -w" "" \
	bridge=github.com/containernetworking/plugins/plugins/main/bridge:1 \
	host-local=github.com/containernetworking/plugins/plugins/ipam/host-local:1 \
	loopback=github.com/containernetworking/plugins/plugins/main/loopback:1

# runc starts the real-runtime nodes' containers: Debian's package, installed
# when missing.
if ! command -v runc >/dev/null; then
	log "installing Debian's runc (apt-get install -y runc)..."
	start=$SECONDS
	if ! apt-get install -y --no-install-recommends runc >&2; then
		apt-get update >&2
		apt-get install -y --no-install-recommends runc >&2
	fi
	log "installed runc in $((SECONDS - start))s"
fi

# The Debian packages test/ociimage makes images of (test/ociimage/debs.txt),
# downloaded once with apt-get into the deb cache; image builds read them
# from there and download nothing.
debs="${TESSERA_CACHE:-$HOME/.cache/tessera}/debs"
missing=()
while read -r pkg; do
	[[ -z "$pkg" || "$pkg" == \#* ]] && continue
	compgen -G "$debs/${pkg}_*.deb" >/dev/null || missing+=("$pkg")
done <"$here/../ociimage/debs.txt"
if ((${#missing[@]} == 0)); then
	log "up to date: $debs"
else
	log "downloading Debian packages ${missing[*]} into $debs..."
	mkdir -p "$debs"
	tmp="$(mktemp -d "$debs/.download-XXXXXX")"
	# apt-get download drops privileges to _apt where it can write.
	chmod 0777 "$tmp"
	if ! (cd "$tmp" && apt-get download "${missing[@]}" >&2); then
		apt-get update >&2
		(cd "$tmp" && apt-get download "${missing[@]}" >&2)
	fi
	mv "$tmp"/*.deb "$debs/"
	rmdir "$tmp"
	log "done: $debs"
fi
