from __future__ import annotations

from pathlib import Path

import pytest

from services.engines.base import KvGeometry, SamplingParams
from services.engines.defaults import DefaultLayers, resolve
from services.engines.registry import ENGINES
from services.engines.transformers.config import TransformersArgs
from services.mesh.config_files import ConfigError
from services.stage.config import load_stage_config
from services.stage.startup.memory import bytes_per_page, plan_memory


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "stage.yaml"
    path.write_text(text)
    return path


def test_valid_file_with_defaults(tmp_path: Path) -> None:
    config = load_stage_config(
        write(tmp_path, "name: a\nengine: transformers\nmodel: /m\ndefaults: {max_tokens: 7}\n")
    )
    assert config.runtime.max_batch_size == 1 and not config.runtime.uses_device_lock
    settings = config.engine_settings()
    assert settings.defaults.max_tokens == 7  # handed to the engine, which resolves them
    assert settings.engine_args == TransformersArgs()  # engine_args left out: all defaults
    layers = DefaultLayers(settings.defaults)
    params = resolve(SamplingParams(temperature=0.1), layers)
    assert params.max_tokens == 7 and params.temperature == 0.1
    assert resolve(SamplingParams(max_tokens=3), layers).max_tokens == 3


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "name: a\nengine: nope\nmodel: m\n",
            f"engine: expected one of {', '.join(sorted(ENGINES))}, or a plug-in",
        ),
        (
            "name: a\nengine: transformers\nmodel: m\nruntime: {max_batch_size: 0}\n",
            "runtime.max_batch_size: Input should be greater than or equal to 1 (got 0)",
        ),
        ("name: a\nengine: transformers\nmodel: m\nruntim: {}\n", "runtim: unknown key"),
        ("engine: transformers\nmodel: m\n", "name: Field required"),
        ("name: a\nengine: [\n", "not valid YAML at line"),
        ("- 1\n", "expected a mapping of settings"),
        (
            "name: a\nengine: diffusers\nload_format: dummy\nengine_args: {gather_ms: -1}\n",
            "engine_args.gather_ms: Input should be greater than or equal to 0 (got -1)",
        ),
        (
            "name: a\nengine: video\nload_format: dummy\nengine_args: {split: 9}\n",
            "engine_args.split: expected auto or a block in 0..2 (got 9)",
        ),
        ("name: a\nengine: nope.mod:Eng\nmodel: m\n", "engine: plug-in engine 'nope.mod:Eng'"),
    ],
)
def test_errors_name_the_file_the_key_and_the_expectation(
    tmp_path: Path, text: str, expected: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_stage_config(path)
    assert str(err.value).startswith(str(path))
    assert expected in str(err.value)


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml: cannot read"):
        load_stage_config(tmp_path / "nope.yaml")


def test_memory_plan_follows_the_design_formula() -> None:
    kv = KvGeometry(layers=30, kv_heads=3, head_dim=64, dtype_bytes=2)
    per_page = bytes_per_page(kv, page_size=16)
    assert per_page == 2 * 64 * 3 * 16 * 2 * 30
    plan = plan_memory(10_000_000_000, 0.88, 1_000_000_000, kv, 16)
    assert plan.cache_pages == (int(10e9 * 0.88) - 1_000_000_000) // per_page
    assert plan.cache_budget_bytes == plan.cache_pages * per_page
    assert plan_memory(100, 0.5, 1_000, kv, 16).cache_pages == 0  # model larger than budget
    assert plan_memory(100, 0.5, 10, None, 16).bytes_per_page == 0
    tp = KvGeometry(layers=30, kv_heads=4, head_dim=64, dtype_bytes=2, tensor_parallel=2)
    assert bytes_per_page(tp, 16) == bytes_per_page(KvGeometry(30, 2, 64, 2), 16)
