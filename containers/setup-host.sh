#!/usr/bin/env bash
# Prepare this machine (Debian 12, root) to build and run the Omni Mesh images with
# podman: no Docker daemon, no registry. Idempotent and cheap when done: CI runs it
# every time and it skips what is already there (see ../shared/CONTAINERS.md).
#
#   1. podman, runc and debootstrap from Debian;
#   2. /etc/containers/containers.conf: runc (crun refuses this kernel's hybrid
#      cgroups) and rlimits below the host's (raising them is not permitted);
#   3. localhost/omni-base:bookworm, a minimal Debian with Python 3.11 built by
#      debootstrap, standing in for python:3.11-slim, which cannot be pulled here.
#   4. node and npm, if missing, for the test of the Node.js client example.
set -euo pipefail

BASE_IMAGE=${OMNI_BASE_IMAGE:-localhost/omni-base:bookworm}

if [[ $(id -u) != 0 ]]; then
    echo "setup-host.sh: needs root (apt-get, /etc/containers, debootstrap)" >&2
    exit 1
fi

missing=()
for tool in podman runc debootstrap; do
    command -v "$tool" >/dev/null || missing+=("$tool")
done
if ((${#missing[@]})); then
    echo "setup-host.sh: installing podman runc debootstrap (missing: ${missing[*]})"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap >/dev/null
fi

if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    echo "setup-host.sh: installing nodejs npm (the Node.js client test)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
fi

conf=/etc/containers/containers.conf
wanted='[containers]
default_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]
[engine]
runtime = "runc"'
if [[ ! -f $conf || $(<"$conf") != "$wanted" ]]; then
    echo "setup-host.sh: writing $conf"
    mkdir -p /etc/containers
    printf '%s\n' "$wanted" >"$conf"
fi

if ! podman image exists "$BASE_IMAGE"; then
    echo "setup-host.sh: building $BASE_IMAGE with debootstrap (about 2 minutes, once)"
    rootfs=$(mktemp -d /var/tmp/omni-rootfs.XXXXXX)
    trap 'rm -rf "$rootfs"' EXIT
    # debootstrap's own default mirror unless DEBIAN_MIRROR names another.
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$rootfs" ${DEBIAN_MIRROR:+"$DEBIAN_MIRROR"} >/dev/null
    # Nothing installs into it later: no apt caches, docs or manuals.
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
        "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/*
    if ! out=$(tar -C "$rootfs" -c . | podman import - "$BASE_IMAGE" 2>&1); then
        echo "$out" >&2
        exit 1
    fi
fi
echo "setup-host.sh: podman $(podman --version | awk '{print $3}'), base image $BASE_IMAGE ready"
