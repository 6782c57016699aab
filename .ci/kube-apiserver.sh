#!/usr/bin/env bash
# Build a real kube-apiserver for the Kubernetes tests (tests/deploy/kube) and install
# the etcd it runs on. No Kubernetes release installs here from a package registry, so:
# Debian bookworm's `kubernetes` *source* package (1.20.2, the full upstream tree with
# vendor/) built with Debian's Go in GOPATH mode, after `make gen_openapi` (needs rsync);
# Debian's etcd-server (3.4). See ../shared/PROBES.md for how this was found.
#
# Idempotent and cheap when done: the binary is cached under
#   ${OMNI_KUBE_CACHE:-~/.cache/omni-mesh/kube-apiserver}/<version>/kube-apiserver
# and the build is skipped when it is there. The outcome is written next to it for the
# test fixture, which waits for it when CI runs this in the background:
#   `building` (this script's pid) while it runs, build.log, then `ok` or `failed`
#   (the fixture fails with the log's tail on `failed`).
# Needs root (apt-get). About 3-5 min on 2 cores, 1.3 GB peak, 34 MB download.
set -euo pipefail

VERSION=1.20.2
CACHE_ROOT=${OMNI_KUBE_CACHE:-$HOME/.cache/omni-mesh/kube-apiserver}
CACHE=$CACHE_ROOT/$VERSION
mkdir -p "$CACHE"

if [[ -x $CACHE/kube-apiserver && -f $CACHE/ok ]] && command -v etcd >/dev/null; then
    echo "kube-apiserver.sh: $CACHE/kube-apiserver is built; etcd is $(command -v etcd)"
    exit 0
fi

rm -f "$CACHE/ok" "$CACHE/failed"
echo $$ >"$CACHE/building"
exec > >(tee "$CACHE/build.log") 2>&1
trap 'echo "kube-apiserver.sh: FAILED (line $LINENO)"; touch "$CACHE/failed"' ERR
trap 'rm -f "$CACHE/building"' EXIT

if [[ $(id -u) != 0 ]]; then
    echo "kube-apiserver.sh: needs root (apt-get)" >&2
    false
fi

need=()
command -v go >/dev/null || need+=(golang-go)
command -v rsync >/dev/null || need+=(rsync)
command -v etcd >/dev/null || need+=(etcd-server)
command -v make >/dev/null || need+=(make)
if ((${#need[@]})); then
    echo "kube-apiserver.sh: installing ${need[*]}"
    apt-get -o DPkg::Lock::Timeout=300 update -qq
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq \
        --no-install-recommends "${need[@]}" >/dev/null
fi
# (Where systemd runs, Debian's etcd-server also starts a system etcd on 2379: left
# alone; the tests run their own on free ports.)

if [[ ! -x $CACHE/kube-apiserver ]]; then
    work=$(mktemp -d)
    trap 'rm -rf "$work" "$CACHE/building"' EXIT
    # The source list lives in a private apt state: the machine's sources stay as they are.
    mkdir -p "$work/apt/lists/partial" "$work/apt/parts"
    cat >"$work/apt/parts/deb-src.sources" <<'EOF'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    apt_private=(-q -o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$work/apt/parts"
        -o "Dir::State::Lists=$work/apt/lists")
    apt-get "${apt_private[@]}" update >/dev/null
    (cd "$work" && apt-get "${apt_private[@]}" source --download-only kubernetes >/dev/null 2>&1)
    orig=$(ls "$work"/kubernetes_*.orig.tar.gz)
    # Debian names it 1.20.5+really1.20.2: the tree inside is the one we want.
    [[ $(tar -tzf "$orig" | head -1) == kubernetes-$VERSION/ ]]
    mkdir -p "$work/gopath/src/k8s.io/kubernetes"
    tar -xzf "$orig" -C "$work/gopath/src/k8s.io/kubernetes" --strip-components=1

    cd "$work/gopath/src/k8s.io/kubernetes"
    export GOPATH=$work/gopath GO111MODULE=off GOCACHE=$work/gocache
    echo "kube-apiserver.sh: make gen_openapi ($(go version))"
    make gen_openapi
    echo "kube-apiserver.sh: go build ./cmd/kube-apiserver"
    go build -o "$CACHE/kube-apiserver.tmp" -ldflags "-s -w \
        -X k8s.io/kubernetes/vendor/k8s.io/component-base/version.gitVersion=v$VERSION \
        -X k8s.io/kubernetes/vendor/k8s.io/client-go/pkg/version.gitVersion=v$VERSION" \
        ./cmd/kube-apiserver
    mv "$CACHE/kube-apiserver.tmp" "$CACHE/kube-apiserver"
    cd /
fi

"$CACHE/kube-apiserver" --version
# sed, not head: head stops reading, etcd then dies of SIGPIPE, and pipefail made
# that a failed build.
etcd --version | sed -n 1p
touch "$CACHE/ok"
echo "kube-apiserver.sh: done: $CACHE/kube-apiserver"
