"""The vllm engine without vLLM: the install hint, its errors, the registry, its
``engine_args`` and sizing. Intake: test_vllm_intake.py; serving on a GPU:
test_vllm_gpu.py."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from transformers import LlamaForCausalLM

from services.engines.base import EngineSettings
from services.engines.registry import engine_class, settings_model
from services.engines.vllm import INSTALL_HINT, VllmArgs, VllmEngine
from services.engines.vllm.config import cpu_list
from services.engines.vllm.sizing import model_bytes
from services.mesh.errors import EngineDead, InitFailed, InvalidArgument
from tests.helpers.vllm_parts import tiny_llama_config


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_load_without_vllm_fails_with_the_install_hint(tmp_path: Path) -> None:
    with pytest.raises(InitFailed) as caught:
        VllmEngine(EngineSettings(device="cuda")).load(tmp_path)
    assert caught.value.message == INSTALL_HINT


def test_a_dead_vllm_engine_is_fatal_for_the_stage() -> None:
    class EngineDeadError(Exception):  # stands in for vllm.v1.engine.exceptions's
        pass

    engine = VllmEngine(EngineSettings(device="cuda"))
    engine._engine_dead = EngineDeadError  # what load() records once vLLM is imported
    dead = engine._translate("r", EngineDeadError("background loop died"))
    assert isinstance(dead, EngineDead) and dead.code.name == "UNAVAILABLE"
    refused = engine._translate("r", ValueError("prompt too long"))
    assert isinstance(refused, InvalidArgument) and refused.field == "inputs"


def test_the_registry_finds_it_without_importing_vllm() -> None:
    code = (
        "import sys; from services.engines.registry import engine_class; "
        "assert engine_class('vllm').name == 'vllm'; assert 'vllm' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
    assert engine_class("vllm") is VllmEngine
    assert settings_model("vllm") is VllmArgs


def test_engine_args_map_to_async_engine_args(tmp_path: Path) -> None:
    settings = EngineSettings(
        device="cuda",
        load_format="dummy",
        engine_args={"memory_ratio": 0.5, "enforce_eager": True, "max_model_len": 256},
    )
    kwargs = VllmArgs.of(settings).async_engine_kwargs(settings, tmp_path)
    assert kwargs["model"] == str(tmp_path) and kwargs["load_format"] == "dummy"
    assert kwargs["gpu_memory_utilization"] == 0.5
    assert kwargs["enforce_eager"] is True and kwargs["max_model_len"] == 256
    assert "memory_ratio" not in kwargs
    explicit = EngineSettings(engine_args={"memory_ratio": 0.5, "gpu_memory_utilization": 0.7})
    assert VllmArgs.of(explicit).async_engine_kwargs(explicit, tmp_path)[
        "gpu_memory_utilization"
    ] == pytest.approx(0.7)


@pytest.mark.parametrize(
    ("device", "dtype", "runs"),
    [
        ("cpu", None, "float32"),
        ("cpu", "auto", "float32"),
        ("cpu", "bfloat16", "bfloat16"),
        ("cuda", None, "auto"),
        ("cuda:1", "auto", "auto"),
    ],
)
def test_auto_precision_is_float32_on_a_cpu(
    tmp_path: Path, device: str, dtype: str | None, runs: str
) -> None:
    # vLLM's own auto takes bfloat16 on a CPU, which changes answers (vllm/config.py).
    settings = EngineSettings(device=device, dtype=dtype)
    assert VllmArgs.of(settings).async_engine_kwargs(settings, tmp_path)["dtype"] == runs


@pytest.mark.parametrize(
    ("engine_args", "field"),
    [
        ({"model": "x"}, "engine_args.model"),
        ({"load_format": "dummy"}, "engine_args.load_format"),
        ({"memory_ratio": 1.5}, "engine_args.memory_ratio"),
        ({"memory_ratio": True}, "engine_args.memory_ratio"),
        ({"defaults": {"max_new_tokens": 3}}, "engine_args.defaults.max_new_tokens"),
        ({"defaults": {"temperature": float("inf")}}, "engine_args.defaults.temperature"),
    ],
)
def test_bad_engine_args_are_refused_by_name(engine_args: dict[str, Any], field: str) -> None:
    with pytest.raises(InitFailed) as caught:
        VllmEngine(EngineSettings(engine_args=engine_args))
    assert caught.value.field == field
    assert caught.value.message.startswith(f"{field}: ")


def test_model_bytes_count_the_architecture_per_rank(tmp_path: Path) -> None:
    config = tiny_llama_config(259)
    params = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    assert model_bytes(config, torch.bfloat16, 1, tmp_path) == 2 * params
    assert model_bytes(config, torch.bfloat16, 2, tmp_path) == params


def test_cpu_settings_become_vllms_environment() -> None:
    default = VllmArgs().cpu.environment()
    assert default["VLLM_CPU_KVCACHE_SPACE"] == "1"  # GiB: small machines first
    assert default["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert default["VLLM_CPU_OMP_THREADS_BIND"] == cpu_list(sorted(os.sched_getaffinity(0)))
    given = VllmArgs.model_validate(
        {"cpu": {"kv_cache_gib": 2.5, "threads_bind": "0-3|4-7", "reserved_cpus": 1}}
    ).cpu.environment()
    assert given == {
        "VLLM_CPU_KVCACHE_SPACE": "2.5",
        "VLLM_CPU_OMP_THREADS_BIND": "0-3|4-7",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    }
    assert cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert "cpu" not in VllmArgs.model_validate({"cpu": {}, "max_num_seqs": 4}).vllm


def test_bad_cpu_settings_stop_the_stage_file_by_name(tmp_path: Path) -> None:
    bad = {"kv_cache_gib": 0, "threads_bind": "0-a", "reserved_cpus": -1, "kv_cache": 1}
    config = tmp_path / "stage.yaml"
    stage = {"name": "s", "engine": "vllm", "model": "m", "engine_args": {"cpu": bad}}
    config.write_text(yaml.safe_dump(stage))
    run = subprocess.run(
        [sys.executable, "-m", "services.stage", "serve", "--config", str(config)],
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 2
    for key in bad:
        assert f"{config}: engine_args.cpu.{key}: " in run.stderr, run.stderr
    assert VllmArgs.model_validate({"cpu": {"threads_bind": "nobind"}}).cpu.threads_bind == "nobind"
