"""`omni up` and what it leaves behind and refuses (issue 19): `--tls` honours the
tokens file, tokens and keys go with the run, a run folder of its own making
goes after a clean run, and a pipeline whose edge names a transform its stage
does not offer fails start-up with exit code 2 naming the edge."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
from pathlib import Path

import yaml

from orchestrator.client import AsyncClient
from services.mesh.security import client_dialing
from services.testing.configs import tiny_config, write_config
from tests.orchestrator.cli.test_up_trust import omni_up, tiny_pipeline, up_to_the_end


def tokens_file(folder: Path, **tokens: str) -> Path:
    entries = [{"name": name, "token": token} for name, token in tokens.items()]
    path = folder / "tokens.yaml"
    path.write_text(yaml.safe_dump({"tokens": entries}))
    return path


async def test_up_with_tls_honours_the_tokens_file_and_removes_its_secrets(
    tmp_path: Path, omni_cache_dir: Path
) -> None:
    pipeline = tiny_pipeline(tmp_path, omni_cache_dir)
    alice = secrets.token_hex(20)
    env = {**os.environ, "OMNI_TOKENS_FILE": str(tokens_file(tmp_path, alice=alice))}
    run = tmp_path / "run"
    async with omni_up(str(pipeline), "--run-dir", str(run), "--tls", env=env) as (up, address):
        ca = run / "pki" / "ca.pem"
        async with AsyncClient(address, client_dialing(token=alice, ca=ca)) as client:
            result = await client.generate("Hi", params={"max_tokens": 2}).collect()
        assert result.ok, result.done  # a listed token, not an admin's
        up.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(up.wait(), 60) == 0
    assert not (run / "pki").exists()  # tokens and keys went with the run
    assert (run / "thinker.log").is_file()  # the folder given is the operator's


async def test_up_removes_the_run_folder_it_made_after_a_clean_run(
    tmp_path: Path, omni_cache_dir: Path
) -> None:
    pipeline = tiny_pipeline(tmp_path, omni_cache_dir)
    temp = tmp_path / "tmp"
    temp.mkdir()
    args = ("--prompt", "Hi", "--max-tokens", "2", "--out", str(tmp_path / "out"))
    code, err = await up_to_the_end(str(pipeline), *args, env={**os.environ, "TMPDIR": str(temp)})
    assert code == 0, err
    assert not [p for p in temp.iterdir() if p.name.startswith("omni-up-")]


async def test_up_refuses_an_edge_transform_its_stage_does_not_offer(
    tmp_path: Path, omni_cache_dir: Path
) -> None:
    runtime = {"torch_threads": 1}
    launch = {
        name: write_config(
            tmp_path / f"{name}.yaml", tiny_config(name, omni_cache_dir, runtime=runtime)
        )
        for name in ("thinker", "talker")
    }
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(
        yaml.safe_dump(
            {
                "name": "rot",
                "stages": [{"name": n, "launch": str(path)} for n, path in launch.items()],
                "edges": [{"from": "thinker", "to": "talker", "transform": "rot13"}],
            }
        )
    )
    code, err = await up_to_the_end(str(pipeline), "--run-dir", str(tmp_path / "run"))
    assert code == 2, err
    assert (
        "stage talker failed: edge thinker -> talker: stage talker does not offer "
        "transform 'rot13'" in err
    )
