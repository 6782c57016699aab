"""Telemetry as an operator sees it: a real OTLP/gRPC receiver on 127.0.0.1 gets
the spans and metrics of the orchestrator and of both stage processes of a
two-stage request, as one trace, when only OTEL_EXPORTER_OTLP_ENDPOINT (and
friends) is set; nothing is set up without it."""

from __future__ import annotations

import asyncio
import socket
import urllib.request
from pathlib import Path

import yaml

from orchestrator.cli.processes import OrchestratorProcess
from orchestrator.client import AsyncClient
from services.mesh.rpc.stage_client import StageClient, chat_submit
from services.mesh.telemetry import tracing
from tests.helpers.otlp import OtlpReceiver, Received
from tests.orchestrator.conftest import RENDER_DIM, Stages, renderer_config, segmented_thinker

ORCHESTRATOR = "omni-orchestrator-traced"
SPOKEN_BY = "omni-orchestrator-spoken"  # the orchestrator of pipeline "spoken"


def test_telemetry_is_off_without_the_standard_environment() -> None:
    assert tracing.setup("omni-test", env={}) is False
    assert tracing.ENABLED is False


def pipeline_file(stages, path: Path) -> Path:
    edges = [{"from": "thinker", "to": "renderer", "window": 4}]
    edges[0]["transform"] = "hidden_states_to_prompt_embeds"
    config = {
        "name": "traced",
        "stages": [{"name": n, "address": stages.addresses[n]} for n in ("thinker", "renderer")],
        "edges": edges,
        "outputs": ["thinker", "renderer"],
    }
    path.write_text(yaml.safe_dump(config))
    return path


async def test_a_request_is_one_trace_and_its_metrics_match_what_happened(
    tmp_path: Path, omni_cache_dir: Path, smollm2_gguf: Path
) -> None:
    with OtlpReceiver() as receiver:
        stages = Stages(tmp_path, env=receiver.env())
        process = None
        try:
            await stages.start(
                {
                    # Full segments of 4 rows (1 KiB), the first included: all by shm.
                    "thinker": segmented_thinker(omni_cache_dir),
                    "renderer": renderer_config(omni_cache_dir),
                }
            )
            process = OrchestratorProcess(
                pipeline_file(stages, tmp_path / "p.yaml"), env=receiver.env()
            )
            address = await process.start()
            async with AsyncClient(address) as client:
                await client.wait_ready(timeout_s=60)
                params = {"max_tokens": 12, "seed": 3}
                result = await client.generate("Paint.", params=params, request_id="t1").collect()
        finally:
            if process is not None:
                await process.stop()  # flushes the exporters
            await stages.stop()
        assert result.ok, result.done
        tokens = len(result.stages["thinker"].token_ids)

        def spans_in(received: Received) -> bool:
            return any(s.name == "omni.request" for s in received.spans)

        spans = receiver.wait_for(spans_in).spans
        root = next(s for s in spans if s.name == "omni.request")
        assert root.service == ORCHESTRATOR and root.attributes["gen_ai.response.id"] == "t1"
        mine = [s for s in spans if s.trace_id == root.trace_id]
        by_name = {s.name: s for s in mine}
        for stage in ("thinker", "renderer"):
            assert by_name[f"omni.stage {stage}"].parent_id == root.span_id
        windows = [s for s in mine if s.name == "omni.window thinker->renderer"]
        assert len(windows) == tokens // 4 + 1  # full windows of 4, then the last (is_last)
        assert {w.parent_id for w in windows} == {by_name["omni.stage renderer"].span_id}
        thinker = by_name["omni.stage thinker"]
        assert thinker.attributes["gen_ai.usage.output_tokens"] == tokens

        # The stages' own spans hang under the orchestrator's span of that stage.
        def stage_spans_in(received: Received) -> bool:
            names = {(s.service, s.name) for s in received.spans if s.trace_id == root.trace_id}
            return {
                ("omni-stage-thinker", "stage.handoff"),
                ("omni-stage-renderer", "stage.compute"),
            } <= names

        spans = receiver.wait_for(stage_spans_in).spans
        mine = [s for s in spans if s.trace_id == root.trace_id]
        for stage in ("thinker", "renderer"):
            served = next(s for s in mine if s.name == f"stage {stage}")
            assert served.service == f"omni-stage-{stage}"
            parent = next((s for s in mine if s.span_id == served.parent_id), None)
            assert served.parent_id == by_name[f"omni.stage {stage}"].span_id, (stage, parent)
            children = {s.name for s in mine if s.parent_id == served.span_id}
            assert {"stage.queue", "stage.compute"} <= children
        handoffs = [
            s for s in mine if s.name == "stage.handoff" and s.service == "omni-stage-thinker"
        ]
        shm = [h for h in handoffs if h.attributes["omni.transport"] == "shm"]
        assert sum(h.attributes["omni.tensor.bytes"] for h in shm) == tokens * RENDER_DIM * 4

        # Metrics: the thinker's hidden states (tokens x RENDER_DIM float32) went
        # by shared memory, the renderer's image as bytes; the tokens counted.
        hidden_bytes = tokens * RENDER_DIM * 4

        def metrics_in(_received: Received) -> bool:
            shm = receiver.latest(
                ORCHESTRATOR,
                "omni.tensor.bytes",
                **{"omni.stage": "thinker", "omni.transport": "shm"},
            )
            return shm == hidden_bytes

        receiver.wait_for(metrics_in)
        image = result.stages["renderer"].tensors["image"][0]
        assert receiver.latest(
            ORCHESTRATOR, "omni.tensor.bytes", **{"omni.stage": "renderer", "omni.transport": "raw"}
        ) == len(image.raw)
        output = {"omni.stage": "thinker", "gen_ai.token.type": "output"}
        assert receiver.latest(ORCHESTRATOR, "omni.tokens", **output) == tokens
        assert receiver.latest(ORCHESTRATOR, "omni.requests", **{"omni.status": "OK"}) == 1
        assert receiver.latest(
            ORCHESTRATOR, "omni.edge.windows", **{"omni.edge": "thinker->renderer"}
        ) == len(windows)


async def test_a_stage_serves_metrics_for_scraping_when_given_a_port(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a free port for the scrape endpoint
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = {
        "name": "scraped",
        "engine": "tests.helpers.engines:ScriptedEngine",
        "load_format": "dummy",
        "cache_dir": str(tmp_path / "cache"),
    }
    stages = Stages(tmp_path, env={"OMNI_PROMETHEUS_PORT": str(port)})
    try:
        await stages.start({"scraped": config})
        async with StageClient(stages.addresses["scraped"]) as stage:
            outputs = [o async for o in stage.generate(chat_submit("p1", "hello", max_tokens=3))]
        assert outputs[-1].WhichOneof("kind") == "completed"
        url = f"http://127.0.0.1:{port}/metrics"
        text = await asyncio.to_thread(
            lambda: urllib.request.urlopen(url, timeout=10).read().decode()
        )
    finally:
        await stages.stop()
    # Both gauges exist for the stage, and read 0 now that the request is over.
    for name in ("omni_stage_running", "omni_stage_queue_depth"):
        line = next(
            (
                ln
                for ln in text.splitlines()
                if ln.startswith(name) and 'omni_stage="scraped"' in ln
            ),
            None,
        )
        assert line is not None and line.rsplit(" ", 1)[1] == "0.0", (name, text[:2000])


async def test_audio_metrics_are_the_audio_as_the_client_hears_it(tmp_path: Path) -> None:
    """A voice stage sends packets of silence at a pace each request asks for: one
    request's 20 ms packets come 250 ms apart (playback runs dry before each of the
    three after the first), the other's 2 s packets 50 ms apart (never dry)."""
    config = {
        "name": "voice",
        "engine": "tests.helpers.engines:ScriptedEngine",
        "load_format": "dummy",
        "cache_dir": str(tmp_path / "cache"),
    }
    with OtlpReceiver() as receiver:
        stages = Stages(tmp_path, env=receiver.env())
        process = None
        try:
            await stages.start({"voice": config})
            path = tmp_path / "voice.yaml"
            pipeline = {"name": "spoken", "stages": [{"name": "voice",
                        "address": stages.addresses["voice"]}], "outputs": ["voice"]}  # fmt: skip
            path.write_text(yaml.safe_dump(pipeline))
            process = OrchestratorProcess(path, env=receiver.env())
            address = await process.start()
            async with AsyncClient(address) as client:
                await client.wait_ready(timeout_s=60)
                choppy = await client.generate("speak 4 20 250", request_id="choppy").collect()
                smooth = await client.generate("speak 3 2000 50", request_id="smooth").collect()
        finally:
            if process is not None:
                await process.stop()  # flushes the exporters
            await stages.stop()
    for result, packets in ((choppy, 4), (smooth, 3)):
        assert result.ok, result.done
        assert len(result.stages["voice"].tensors["audio"]) == packets  # each its own segment
    at = {"omni.stage": "voice"}

    def audio_in(_received: Received) -> bool:
        return receiver.latest(SPOKEN_BY, "omni.audio.real_time_factor", **at) is not None

    receiver.wait_for(audio_in)
    # Histograms arrive as sums over both requests; the counter counts choppy's alone.
    assert receiver.latest(SPOKEN_BY, "omni.audio.underruns", **at) == 3
    rtf = receiver.latest(SPOKEN_BY, "omni.audio.real_time_factor", **at)
    assert rtf is not None and rtf >= 0.75 / 0.08  # choppy: >= 3 x 250 ms for 80 ms of audio
    # Buckets made for them: seconds to the first packet, real-time factors around 1.
    bounds = receiver.received.bounds
    assert 0.1 in bounds[(SPOKEN_BY, "omni.audio.time_to_first_packet")]
    assert 1.0 in bounds[(SPOKEN_BY, "omni.audio.real_time_factor")]
    first = receiver.latest(SPOKEN_BY, "omni.audio.time_to_first_packet", **at)
    assert first is not None and 0 < first < choppy.done.total_ms / 1e3 + smooth.done.total_ms / 1e3
