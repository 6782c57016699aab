"""Telemetry as an operator sees it: a real OTLP/gRPC receiver on 127.0.0.1 gets
the orchestrator's spans and metrics when only OTEL_EXPORTER_OTLP_ENDPOINT (and
friends) is set; nothing is set up without it."""

from __future__ import annotations

from pathlib import Path

import yaml

from orchestrator.client import AsyncClient
from orchestrator.stages.processes import OrchestratorProcess
from services.mesh import telemetry
from tests.helpers.otlp import OtlpReceiver, Received
from tests.orchestrator.conftest import RENDER_DIM

ORCHESTRATOR = "omni-orchestrator-traced"


def test_telemetry_is_off_without_the_standard_environment() -> None:
    assert telemetry.setup("omni-test", env={}) is False
    assert telemetry.ENABLED is False


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
    stages, tmp_path: Path
) -> None:
    with OtlpReceiver() as receiver:
        process = OrchestratorProcess(
            pipeline_file(stages, tmp_path / "p.yaml"), env=receiver.env()
        )
        address = await process.start()
        try:
            async with AsyncClient(address) as client:
                await client.wait_ready(timeout_s=60)
                params = {"max_tokens": 12, "seed": 3}
                result = await client.generate("Paint.", params=params, request_id="t1").collect()
        finally:
            await process.stop()  # flushes the exporters
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
        assert len(windows) == -(-tokens // 4)  # one span per window of 4 tokens
        assert {w.parent_id for w in windows} == {by_name["omni.stage renderer"].span_id}
        thinker = by_name["omni.stage thinker"]
        assert thinker.attributes["gen_ai.usage.output_tokens"] == tokens

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
