"""Config and command-line mistakes, run as a user runs them: each exits 2 with
one message naming the file (or variable, or flag), the key and what was expected."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.testing.configs import tiny_config, write_config

OMNI = str(Path(sys.executable).parent / "omni")


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [OMNI, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def stage_serve(config: Path, *extra: str, env: dict[str, str] | None = None):
    return run("stage", "serve", "--config", str(config), "--port", "0", *extra, env=env)


@pytest.fixture
def good_stage(tmp_path: Path, omni_cache_dir: Path) -> dict:
    return tiny_config("thinker", omni_cache_dir)


def test_a_stage_file_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"name: caf\xe9\nengine: transformers\n")
    done = stage_serve(path)
    assert done.returncode == 2, done.stderr
    assert f"{path}: expected UTF-8 text, found byte 0xe9" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_pipeline_file_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "pipe.yaml"
    path.write_bytes(b"name: \xff\n")
    done = run("orchestrator", "serve", "--pipeline", str(path), "--port", "0")
    assert done.returncode == 2 and f"{path}: expected UTF-8 text" in done.stderr


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"dtype": "float13"}, "dtype: 'float13' is not one of"),
        ({"runtime": {"max_batch_size": True}}, "runtime.max_batch_size: expected a number"),
    ],
    ids=["dtype", "max_batch_size_true"],
)
def test_bad_engine_settings(tmp_path: Path, good_stage: dict, change: dict, expected: str) -> None:
    for key, value in change.items():
        if isinstance(value, dict):
            good_stage[key] = {**good_stage.get(key, {}), **value}
        else:
            good_stage[key] = value
    path = write_config(tmp_path / "stage.yaml", good_stage)
    done = stage_serve(path)
    assert done.returncode == 2, done.stderr
    assert f"omni stage: {path}: {expected}" in done.stderr
    assert "Traceback" not in done.stderr


TRANSFORMERS_KEYS = "defaults, config_overrides, prefill_tokens, gather_ms, weights"


@pytest.mark.parametrize(
    ("engine", "engine_args", "expected"),
    [
        (
            "transformers",
            {"no_such_key": 1},
            f"engine_args.no_such_key: unknown key; expected one of {TRANSFORMERS_KEYS}",
        ),
        (
            "transformers",
            {"weights": "yes"},
            "engine_args.weights: Input should be 'auto', 'gguf_blocks', 'packed' or 'plain'"
            " (got 'yes')",
        ),
        (
            "transformers",
            {"defaults": {"top_p": 2}},
            "engine_args.defaults.top_p: Input should be less than or equal to 1 (got 2)",
        ),
        (
            "transformers",  # a key checked against the rest of the stage file
            {"config_overrides": {"num_hidden_layers": 1}},
            "engine_args.config_overrides: needs load_format: dummy",
        ),
        (
            "diffusers",
            {"num_steps": 4},
            "engine_args.num_steps: unknown key; expected one of num_inference_steps,",
        ),
        (
            "diffusers",
            {"gather_ms": -1},
            "engine_args.gather_ms: Input should be greater than or equal to 0 (got -1)",
        ),
    ],
    ids=["key", "value", "nested", "stage_file", "diffusers_key", "diffusers_value"],
)
def test_bad_engine_args_stop_the_stage_naming_the_file_and_the_key(
    tmp_path: Path, omni_cache_dir: Path, engine: str, engine_args: dict, expected: str
) -> None:
    # Validated with the stage file, by the engine's own settings model, before
    # anything starts: every engine the same way.
    config = {"name": "s", "engine": engine, "engine_args": engine_args}
    config |= {"cache_dir": str(omni_cache_dir), "model": "/nowhere"}
    path = write_config(tmp_path / "stage.yaml", config)
    done = subprocess.run(
        [sys.executable, "-m", "services.stage", "serve", "--config", str(path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert f"omni stage: {path}: {expected}" in done.stderr
    assert "Traceback" not in done.stderr and "listening" not in done.stdout


def test_a_bad_mesh_id(tmp_path: Path, good_stage: dict) -> None:
    path = write_config(tmp_path / "stage.yaml", good_stage)
    done = stage_serve(path, env={"OMNI_MESH_ID": "Bad/Mesh"})
    assert done.returncode == 2, done.stderr
    assert "omni stage: OMNI_MESH_ID: mesh id 'Bad/Mesh': expected 1-31 of a-z" in done.stderr
    pipeline = tmp_path / "pipe.yaml"
    pipeline.write_text(
        yaml.safe_dump({"name": "p", "stages": [{"name": "a", "address": "127.0.0.1:1"}]})
    )
    done = run(
        "orchestrator",
        "serve",
        "--pipeline",
        str(pipeline),
        "--port",
        "0",
        env={"OMNI_MESH_ID": "-x"},
    )
    assert done.returncode == 2 and "OMNI_MESH_ID: mesh id '-x'" in done.stderr


@pytest.mark.parametrize("port", ["70000", "-1", "http"])
def test_a_port_out_of_range_is_refused(tmp_path: Path, good_stage: dict, port: str) -> None:
    path = write_config(tmp_path / "stage.yaml", good_stage)
    for done in (
        run("stage", "serve", "--config", str(path), "--port", port),
        run("orchestrator", "serve", "--pipeline", str(path), "--port", port),
        run("up", "--port", port),
    ):
        assert done.returncode == 2
        assert "argument --port: expected a port" in done.stderr


def test_security_files_that_cannot_be_used(tmp_path: Path) -> None:
    pipeline = tmp_path / "pipe.yaml"
    pipeline.write_text(
        yaml.safe_dump({"name": "p", "stages": [{"name": "a", "address": "127.0.0.1:1"}]})
    )
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(yaml.safe_dump({"tokens": [{"name": "alice", "token": "short"}]}))
    done = run(
        "orchestrator",
        "serve",
        "--pipeline",
        str(pipeline),
        "--port",
        "0",
        "--tokens-file",
        str(tokens),
    )
    assert done.returncode == 2, done.stderr
    assert f"{tokens}: tokens.0.token: String should have at least 16 characters" in done.stderr
    done = run(
        "orchestrator",
        "serve",
        "--pipeline",
        str(pipeline),
        "--port",
        "0",
        "--tls-cert",
        str(tmp_path / "cert.pem"),
    )
    assert done.returncode == 2
    assert "tls_cert and tls_key: expected both or neither" in done.stderr
