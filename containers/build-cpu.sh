#!/usr/bin/env bash
# Build the CPU image with podman on our machines:  containers/build-cpu.sh [TAG] [podman build args...]
# (OMNI_CONTAINERFILE=containers/Containerfile.vllm-cpu builds that one, the same way.)
#
# Elsewhere `podman build -f containers/Containerfile.cpu .` is enough. Here no
# registry can be reached, so the base is the local Debian image that
# setup-host.sh imports, and pip goes through the package proxy: its CA bundle
# ($PIP_CERT) and the CPU torch wheel folder ($PIP_FIND_LINKS) are lent to the
# build read-only, as build arguments that never reach the image.
set -euo pipefail
cd "$(dirname "$0")/.."

tag=${1:-localhost/omni:cpu}
args=(--network host --build-arg "BASE=${OMNI_BASE_IMAGE:-localhost/omni-base:bookworm}")
if [[ -n ${PIP_CERT:-} ]]; then
    certs=$(dirname "$PIP_CERT")
    args+=(-v "$certs:$certs:ro" --build-arg "PIP_CERT=$PIP_CERT")
fi
if [[ -n ${PIP_FIND_LINKS:-} ]]; then
    # The CPU torch wheel is there: take it instead of PyTorch's index.
    args+=(-v "$PIP_FIND_LINKS:$PIP_FIND_LINKS:ro" --build-arg "PIP_FIND_LINKS=$PIP_FIND_LINKS")
    args+=(--build-arg "TORCH_INDEX_URL=${TORCH_INDEX_URL:-}")
fi
exec podman build "${args[@]}" "${@:2}" -f "${OMNI_CONTAINERFILE:-containers/Containerfile.cpu}" -t "$tag" .
