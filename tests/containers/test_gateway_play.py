"""The chart's gateway (gateway.enabled) played with `podman kube play` beside the
rest of the mesh on the CPU image: the official OpenAI SDK gets from it, through
the played orchestrator and stages, the answer the gRPC client gets for the same
greedy request, /v1/audio/speech answers a WAV spoken by the image's voice, and
a /v1/realtime session (a WebSocket through the gateway's port) speaks the answer
the chat completion speaks."""

from __future__ import annotations

import asyncio
import base64
import io
import time
import wave
from pathlib import Path

import httpx
import pytest
import yaml
from openai import AsyncOpenAI, OpenAI

from orchestrator.client import AsyncClient
from tests.containers import podman
from tests.containers.test_kube_play import PODMAN_VALUES, RELEASE, _free_ports
from tests.deploy.chart import load_values as chart_values
from tests.deploy.chart import merge, render
from tests.helpers.realtime import respond, until, user_text

pytestmark = [pytest.mark.container, pytest.mark.timeout(1800)]

PROMPT = "Describe a red apple."


def _manifests(image: str, tmp_path: Path) -> tuple[Path, dict[str, int]]:
    repository, tag = image.rsplit(":", 1)
    names = ["orchestrator", "thinker", "renderer", "speaker", "recogniser", "gateway"]
    ports = dict(zip(names, _free_ports(len(names)), strict=True))
    values = merge(
        chart_values(PODMAN_VALUES),
        {
            "image": {"repository": repository, "tag": tag},
            "orchestrator": {"port": ports["orchestrator"]},
            "stages": {
                name: {"port": ports[name]}
                for name in ("thinker", "renderer", "speaker", "recogniser")
            },
            "gateway": {"enabled": True, "port": ports["gateway"]},
        },
    )
    docs = podman.podman_compatible(render(values, name=RELEASE))
    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return path, ports


async def _ready(url: str, timeout_s: float) -> None:
    """The gateway's /ready (the orchestrator serves, every stage READY), polled."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=10) as http:
        while True:
            try:
                if (await http.get(url)).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not ready in {timeout_s:.0f}s")
            await asyncio.sleep(1.0)


async def test_the_played_gateway_answers_the_openai_sdk(
    cpu_image: podman.Image, figures: dict[str, object], tmp_path: Path
) -> None:
    manifests, ports = _manifests(cpu_image.ref, tmp_path)
    root = f"http://127.0.0.1:{ports['gateway']}"
    with podman.machine_lock():
        began = time.monotonic()
        with podman.kube_played(manifests) as pods:
            units = sorted(pod.removeprefix(f"{RELEASE}-").split("-pod")[0] for pod in pods)
            assert units == [
                "gateway",
                "orchestrator",
                "recogniser",
                "renderer",
                "speaker",
                "thinker",
            ], pods
            await _ready(f"{root}/ready", 900)
            figures["gateway_kube_play_to_ready_s"] = round(time.monotonic() - began, 1)

            params = {"max_tokens": 16, "temperature": 0.0, "seed": 0}
            async with AsyncClient(f"127.0.0.1:{ports['orchestrator']}") as client:
                direct = await client.generate(PROMPT, params=params).collect()
            assert direct.ok, direct.done

            sdk = OpenAI(base_url=f"{root}/v1", api_key="x", max_retries=0, timeout=300)
            models = await asyncio.to_thread(sdk.models.list)
            (model,) = [m.id for m in models.data]
            reply = await asyncio.to_thread(
                lambda: sdk.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": PROMPT}], **params
                )
            )
            assert reply.choices[0].message.content == direct.stages["thinker"].text
            assert reply.usage is not None
            assert reply.usage.completion_tokens == len(direct.stages["thinker"].token_ids)

            speech = await asyncio.to_thread(
                lambda: sdk.audio.speech.create(
                    model=model, input="Hello from the pod.", voice="heart", response_format="wav"
                )
            )
            with wave.open(io.BytesIO(speech.content)) as spoken:
                assert spoken.getframerate() == 24000 and spoken.getnframes() > 24000 // 2

            # The WebSocket path through the gateway's port: a realtime turn is spoken
            # as the chat completion of the same message is.
            said = await asyncio.to_thread(
                lambda: sdk.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": PROMPT}],
                    modalities=["text", "audio"],
                    audio={"voice": "alloy", "format": "pcm16"},
                    max_tokens=16,
                )
            )
            assert said.choices[0].message.audio is not None
            realtime = AsyncOpenAI(base_url=f"{root}/v1", api_key="x", max_retries=0, timeout=300)
            async with realtime.realtime.connect(model=model) as connection:
                await until(connection, "session.created")
                await connection.conversation.item.create(item=user_text(PROMPT))
                turn = await respond(connection, max_output_tokens=16)
            assert turn.transcript == said.choices[0].message.audio.transcript
            assert turn.pcm == base64.b64decode(said.choices[0].message.audio.data)
    docs = [d for d in yaml.safe_load_all(manifests.read_text()) if d]
    assert podman.pods_of(docs) == []  # taken down on the way out
