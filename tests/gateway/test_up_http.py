"""`omni up --http PORT` as a user runs it: the mesh and a gateway come up, the
OpenAI SDK gets an answer, a gateway killed is started again on its port, and
Ctrl-C stops every process, the gateway too.
With --tls the gateway speaks TLS to the orchestrator, and callers need the
admin token as their API key."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import openai
import psutil
import pytest
import yaml
from openai import OpenAI

from tests.helpers.reference_answer import Reference, ReferenceLM
from tests.orchestrator.cli.test_up import read_until

REPO = Path(__file__).resolve().parents[2]
OMNI = str(Path(sys.executable).parent / "omni")


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "tls"])
async def test_up_with_http_serves_the_openai_api_until_ctrl_c(
    tls: bool, tmp_path: Path, omni_cache_dir: Path, smollm2_reference: ReferenceLM
) -> None:
    run = tmp_path / "run"
    up = await asyncio.create_subprocess_exec(
        OMNI, "up", str(REPO / "examples/pipelines/chat.yaml"), "--port", "0", "--http", "0",
        "--run-dir", str(run), *(["--tls"] if tls else []),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "OMNI_CACHE_DIR": str(omni_cache_dir)},
    )  # fmt: skip
    assert up.stdout is not None
    try:
        await read_until(up.stdout, "ready in", 240)
        line = await read_until(up.stdout, "gateway at", 60)
        base_url = line.split()[2]
        children = psutil.Process(up.pid).children(recursive=True)
        assert len(children) == 2  # the stage and the gateway

        api_key = (run / "pki" / "admin.token").read_text().strip() if tls else "x"
        sdk = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
        question = [{"role": "user", "content": "What is the capital of France?"}]
        # What the chat stage says on this machine (its stage file's max_tokens).
        chat_file = yaml.safe_load((REPO / "examples/stages/chat.yaml").read_text())
        said = smollm2_reference.answer(question[0]["content"], chat_file["defaults"]["max_tokens"])
        reply = await asyncio.to_thread(
            lambda: sdk.chat.completions.create(model="chat", messages=question)
        )
        said.assert_text(reply.choices[0].message.content or "")
        if tls:
            stranger = OpenAI(base_url=base_url, api_key="x" * 20, max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                await asyncio.to_thread(lambda: stranger.models.list())
        else:
            # A crashed gateway is started again on its port, as a stage would be.
            (gateway,) = [c for c in children if "services.gateway" in c.cmdline()]
            gateway.kill()
            await _answers_again(sdk, question, said, 60)
            children = psutil.Process(up.pid).children(recursive=True)
            (again,) = [c for c in children if "services.gateway" in c.cmdline()]
            assert again.pid != gateway.pid

        up.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(up.wait(), 60) == 0
        assert not [c for c in children if c.is_running() and c.status() != "zombie"]
    finally:
        if up.returncode is None:
            up.kill()
            await up.wait()


async def _answers_again(
    sdk: OpenAI, question: list[dict[str, str]], said: Reference, timeout_s: float
) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            reply = await asyncio.to_thread(
                lambda: sdk.chat.completions.create(model="chat", messages=question)
            )
            said.assert_text(reply.choices[0].message.content or "")
            return
        except openai.APIConnectionError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.2)
