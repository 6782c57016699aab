"""Instruction sets a CPU lists but its virtual machine does not let run.

Met so far: AMX on an Intel Xeon guest. ``/proc/cpuinfo`` lists ``amx_tile``, but
tile instructions fault there (llama.cpp built with ``GGML_NATIVE`` dies at
``ldtilecfg``). Of what a stage runs, our kernels use no AMX (they are chosen by
``__builtin_cpu_supports``, which asks the OS through XCR0 as well as the CPU), but
oneDNN (torch's bfloat16 and int8 products, and vLLM's CPU build) picks AMX for
itself wherever the CPU and the kernel say it may.

So before an engine loads, a CPU that lists AMX gets one bfloat16 product run in a
child process with oneDNN free to use it. If the child dies by a signal, oneDNN is
capped below AMX (``ONEDNN_MAX_CPU_ISA``) in this process and in every process it
starts (vLLM's engine core inherits it), and the stage says so in its start-up log
and in ``compute``. A CPU that lists no AMX costs nothing; an operator's own
``ONEDNN_MAX_CPU_ISA`` is left as it is.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

CAP = "ONEDNN_MAX_CPU_ISA"
BELOW_AMX = "AVX512_CORE_BF16"  # oneDNN's best x86 ISA short of AMX that AMX CPUs all have
# Large enough for oneDNN's AMX (brgemm) kernels, which load a tile configuration.
_PRODUCT = (
    "import torch\n"
    "a = torch.randn(256, 256, dtype=torch.bfloat16)\n"
    "torch.nn.functional.linear(a, a)\n"
    "print('survived', flush=True)\n"
)


@dataclass(frozen=True)
class Probe:
    """What one bfloat16 product did in a child process."""

    survived: bool
    detail: str  # the signal it died of, or oneDNN's words on the ISA it used


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's flags as the kernel lists them (empty where unreadable)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def probe(code: str = _PRODUCT, timeout_s: float = 60.0, *, uncapped: bool = True) -> Probe:
    """Run ``code`` (by default one bfloat16 product) in a child, with oneDNN uncapped
    unless ``uncapped`` is False (then under this process's cap)."""
    env = {k: v for k, v in os.environ.items() if k != CAP or not uncapped}
    env["ONEDNN_VERBOSE"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if done.returncode < 0:
        return Probe(False, f"killed by signal {-done.returncode}")
    if done.returncode != 0 or "survived" not in done.stdout:
        # An ordinary failure (no torch, say) is no verdict on the CPU.
        return Probe(True, f"exit {done.returncode}: {done.stderr.strip()[-200:]}")
    isa = [line for line in done.stdout.splitlines() if "isa:" in line]
    return Probe(True, isa[0].split("isa:", 1)[1].strip() if isa else "")


@functools.cache
def guard() -> str:
    """Cap oneDNN below AMX where the CPU lists it but a product using it faults.
    Returns what was done, for the stage's log and ``compute`` ("" when nothing)."""
    return decide(cpu_flags(), probe)


def decide(flags: frozenset[str], run: Callable[[], Probe]) -> str:
    """``guard`` for these CPU flags, ``run`` probing only where they list AMX."""
    if CAP in os.environ or "amx_tile" not in flags:
        return ""
    result = run()
    if result.survived:
        logger.info("AMX is listed and runs here (oneDNN: %s)", result.detail or "no ISA line")
        return ""
    os.environ[CAP] = BELOW_AMX
    note = (
        f"oneDNN capped at {BELOW_AMX}: the CPU lists AMX but a product using it "
        f"was {result.detail}"
    )
    logger.warning("%s", note)
    return note
