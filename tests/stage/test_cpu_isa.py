"""What a stage computes with is what this machine's OS lets run: our kernels'
variant matches the instruction sets the kernel lists (it drops those whose
registers the OS has not enabled), and oneDNN is capped below AMX where the CPU
lists AMX but a product using it dies (an Intel guest where tile instructions
fault), with the stage saying so."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from services import kernels
from services.kernels import library
from services.stage.startup import cpu_isa

FLAGS = cpu_isa.cpu_flags()
# What each variant's code uses (services/kernels/csrc/x86/*.cpp), in /proc/cpuinfo's words.
NEEDS = {
    "reference": set(),
    "avx2": {"avx2", "fma", "f16c"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "fma", "f16c"},
    "avx512vnni": {"avx512f", "avx512bw", "avx512vl", "fma", "f16c", "avx512_vnni"},
}
# Whether torch hands a bfloat16 product to oneDNN here (it needs AVX-512 with BF16 or
# better); elsewhere (an AVX2-only CPU) the product runs outside oneDNN, which names no ISA.
ONEDNN_BF16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def test_the_kernels_run_exactly_the_variants_the_os_enables() -> None:
    built = library.build_variants()
    if not built:
        pytest.skip(f"the kernels are not built here: {kernels.unavailable()}")
    assert set(built) <= set(NEEDS), f"a variant without its needs listed here: {built}"
    assert FLAGS, "/proc/cpuinfo lists no flags"
    assert kernels.runnable() == [v for v in built if NEEDS[v] <= FLAGS]


def test_a_product_that_runs_names_the_isa_onednn_chose() -> None:
    result = cpu_isa.probe()
    assert result.survived, result
    if ONEDNN_BF16:
        assert result.detail, f"oneDNN ran the product but named no ISA: {result}"
    else:
        assert result.detail == "", f"no oneDNN bfloat16 here, yet: {result}"


def test_a_product_killed_by_a_signal_is_a_verdict() -> None:
    faulting = f"import os; os.kill(os.getpid(), {int(signal.SIGILL)})"
    result = cpu_isa.probe(faulting)
    assert result == cpu_isa.Probe(False, f"killed by signal {int(signal.SIGILL)}")
    # An ordinary failure says nothing about the CPU.
    assert cpu_isa.probe("raise SystemExit(1)").survived


def test_amx_that_faults_caps_onednn_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpu_isa.CAP, raising=False)
    faulting = f"import os; os.kill(os.getpid(), {int(signal.SIGILL)})"
    note = cpu_isa.decide(FLAGS | {"amx_tile"}, lambda: cpu_isa.probe(faulting))
    assert os.environ[cpu_isa.CAP] == cpu_isa.BELOW_AMX
    assert note.startswith(f"oneDNN capped at {cpu_isa.BELOW_AMX}") and "signal" in note
    # Capped, a bfloat16 product still runs, on an ISA short of AMX.
    capped = cpu_isa.probe(uncapped=False)
    assert capped.survived and "AMX" not in capped.detail, capped
    assert bool(capped.detail) == ONEDNN_BF16, capped


def test_amx_that_runs_or_no_amx_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpu_isa.CAP, raising=False)
    assert cpu_isa.decide(FLAGS | {"amx_tile"}, cpu_isa.probe) == ""
    assert cpu_isa.decide(FLAGS - {"amx_tile"}, lambda: pytest.fail("probed")) == ""
    # An operator's own cap is theirs: nothing is probed.
    monkeypatch.setenv(cpu_isa.CAP, "AVX2")
    assert cpu_isa.decide(FLAGS | {"amx_tile"}, lambda: pytest.fail("probed")) == ""
    assert os.environ[cpu_isa.CAP] == "AVX2"
