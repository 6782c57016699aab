"""The rendered chart, run for real: charts/ rendered with real Helm and the
local-play values (host network, distinct ports), played with `podman kube play`
on the CPU image; a prompt through the orchestrator Pod comes back with text, an
image and the speaker's speech (a WAV of non-silent audio, from the voice inside
the image), and a stage container answers grpcurl's health and InitStatus, whose
LOAD_DONE says the thinker runs on the GGUF block kernels the image was built with."""

from __future__ import annotations

import asyncio
import socket
import time
import wave
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from orchestrator.cli.outputs import save_outputs
from orchestrator.client import AsyncClient, Result
from services.engines.transformers.loading import kernels_refuse
from tests.containers import podman
from tests.deploy.chart import CHART_DIR, load_values, merge, render
from tests.helpers.grpcurl import grpcurl, health, json_stream
from tests.helpers.reference_answer import ReferenceLM

pytestmark = [pytest.mark.container, pytest.mark.timeout(1800)]

PODMAN_VALUES = CHART_DIR / "ci" / "podman-values.yaml"
# A fixed release: its model-cache claim is a podman volume of the same name that
# keeps the converted SmolLM2 between runs on one machine (the machine lock keeps
# two runs from playing it at once).
RELEASE = "omni-ci"
# SmolLM2-135M: 30 layers of q, k, v, o, gate, up and down, and the output head.
SMOLLM2_LINEARS = 30 * 7 + 1


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _manifests(image: str, tmp_path: Path) -> tuple[Path, dict[str, int]]:
    repository, tag = image.rsplit(":", 1)
    orchestrator, thinker, renderer, speaker, recogniser = _free_ports(5)
    ports = {
        "orchestrator": orchestrator,
        "thinker": thinker,
        "renderer": renderer,
        "speaker": speaker,
        "recogniser": recogniser,
    }
    values = merge(
        load_values(PODMAN_VALUES),
        {
            "image": {"repository": repository, "tag": tag},
            "orchestrator": {"port": orchestrator},
            "stages": {
                "thinker": {"port": thinker},
                "renderer": {"port": renderer},
                "speaker": {"port": speaker},
                "recogniser": {"port": recogniser},
            },
        },
    )
    docs = podman.podman_compatible(render(values, name=RELEASE))
    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return path, ports


async def test_rendered_chart_answers_a_prompt_with_text_an_image_and_speech_under_podman(
    cpu_image: podman.Image,
    figures: dict[str, object],
    tmp_path: Path,
    smollm2_reference: ReferenceLM,
) -> None:
    manifests, ports = _manifests(cpu_image.ref, tmp_path)
    with podman.machine_lock():
        began = time.monotonic()
        with podman.kube_played(manifests) as pods:
            units = sorted(pod.removeprefix(f"{RELEASE}-").split("-pod")[0] for pod in pods)
            assert units == ["orchestrator", "recogniser", "renderer", "speaker", "thinker"], pods
            (thinker_pod,) = (pod for pod in pods if pod.startswith(f"{RELEASE}-thinker-pod"))
            async with AsyncClient(f"127.0.0.1:{ports['orchestrator']}") as client:
                await client.wait_ready(timeout_s=900)
                ready_s = time.monotonic() - began
                asked = time.monotonic()
                result = Result(audio_dir=tmp_path / "out")  # the speech, as it comes
                async for event in client.generate(
                    "Describe a red apple.", params={"max_tokens": 16}, request_id="podman-1"
                ):
                    result.add(event)
                answer_s = time.monotonic() - asked
            assert result.ok, result.done
            thinker = result.stages["thinker"]
            # What this machine's float32 run says, not a length the CPU decides.
            smollm2_reference.answer("Describe a red apple.", 16).assert_said(thinker.token_ids)
            assert thinker.text.strip()
            saved = save_outputs(result, "podman-1", tmp_path / "out")
            (png,) = [path for path in saved if path.suffix == ".png"]
            with Image.open(png) as image:
                assert image.size == (64, 64) and image.mode == "RGB"
            # The speaker said the answer with the packaged voice, inside the image.
            (spoken,) = [path for path in saved if path.suffix == ".wav"]
            assert spoken.name.endswith("-speaker.wav"), spoken
            with wave.open(str(spoken)) as w:
                assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
                pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
            speech_s = len(pcm) / 24000
            assert speech_s > 0.5 and np.abs(pcm).max() > 3000, speech_s  # speech, not silence

            orchestrator = f"127.0.0.1:{ports['orchestrator']}"
            assert (
                await asyncio.to_thread(health, orchestrator, "omni.v1.Orchestrator") == "SERVING"
            )
            stage = f"127.0.0.1:{ports['thinker']}"
            assert await asyncio.to_thread(health, stage, "omni.v1.Stage") == "SERVING"
            assert await asyncio.to_thread(health, stage, "liveness") == "SERVING"
            events = json_stream(
                await asyncio.to_thread(grpcurl, stage, "omni.v1.Stage/InitStatus")
            )
            phases = [event["phase"] for event in events]
            assert phases[0] == "STARTING" and phases[-1] == "READY", phases
            assert {"LOAD_DONE", "MEMORY_PLANNED"} <= set(phases)
            # How the thinker holds its linears: on the kernels built into the image.
            (loaded,) = [e.get("message", "") for e in events if e["phase"] == "LOAD_DONE"]
            if kernels_refuse() is None:  # the engine's own decision, for this CPU
                assert f"{SMOLLM2_LINEARS} linears on GGUF blocks" in loaded, loaded
            else:
                assert "packed for oneDNN" in loaded and "GGUF blocks" not in loaded, loaded

            # The chart's hardening holds under podman too.
            inspected = podman.run(
                "inspect",
                "--format",
                "{{.Config.User}} {{.HostConfig.ReadonlyRootfs}}",
                podman.container_of(thinker_pod, "thinker"),
            ).stdout.split()
            assert inspected == ["10001:10001", "true"], inspected
    docs = [d for d in yaml.safe_load_all(manifests.read_text()) if d]
    assert podman.pods_of(docs) == []  # taken down on the way out
    figures.update(
        image=cpu_image.ref,
        image_size_mb=round(cpu_image.size_bytes / 1e6),
        image_build_s=None if cpu_image.build_s is None else round(cpu_image.build_s, 1),
        kube_play_to_ready_s=round(ready_s, 1),
        first_answer_s=round(answer_s, 2),
        speech_s=round(speech_s, 2),
    )
    print(f"\nkube play to READY: {ready_s:.1f}s, first answer {answer_s:.2f}s")
