"""The mesh's metric instruments, named once (GenAI semantic conventions where
they fit, ``omni.*`` otherwise). They are the API's proxies until
``tracing.setup`` installs a provider; callers check ``tracing.ENABLED``
before recording, so telemetry off costs nothing on the hot path.

Attributes: ``omni.stage``, ``omni.edge`` ("a->b"), ``omni.transport``
(raw, chunked, shm, cuda_ipc), ``omni.status`` (a gRPC status name),
``omni.init.phase``, ``gen_ai.token.type`` (input, output).
"""

from __future__ import annotations

from services.mesh.telemetry import tracing

_meter = tracing.meter()

TIME_TO_FIRST_TOKEN = _meter.create_histogram(
    "gen_ai.server.time_to_first_token",
    unit="s",
    description="Submitted to a stage until its first segment, per stage",
)
TIME_PER_OUTPUT_TOKEN = _meter.create_histogram(
    "gen_ai.server.time_per_output_token",
    unit="s",
    description="Time per output token after the first, per stage",
)
STAGE_REQUEST_DURATION = _meter.create_histogram(
    "gen_ai.server.request.duration",
    unit="s",
    description="Submitted to a stage until its final event, per stage",
)
REQUEST_DURATION = _meter.create_histogram(
    "omni.request.duration", unit="s", description="End to end through the mesh, per status"
)
REQUESTS = _meter.create_counter(
    "omni.requests", description="Requests finished, by status and the stage that ended them"
)
TOKENS = _meter.create_counter(
    "omni.tokens", description="Tokens per stage, by gen_ai.token.type (input, output)"
)
QUEUE_DEPTH = _meter.create_up_down_counter(
    "omni.stage.queue.depth", description="Requests waiting to run in a stage"
)
RUNNING = _meter.create_up_down_counter(
    "omni.stage.running", description="Requests running in a stage (its running batch)"
)
BLOCKED = _meter.create_counter(
    "omni.edge.blocked.time",
    unit="s",
    description="Upstream reads held back by an edge's high watermark (omni.edge) or a slow client",
)
WINDOWS = _meter.create_counter("omni.edge.windows", description="Windows forwarded per edge")
TENSOR_BYTES = _meter.create_counter(
    "omni.tensor.bytes", unit="By", description="Tensor bytes handed over, per transport and stage"
)
INIT_PHASE_DURATION = _meter.create_histogram(
    "omni.stage.init.phase.duration",
    unit="s",
    description="Start-up phases of each stage (download included)",
)
# A speaking pipeline's audio as its client hears it (orchestrator/server/requests/audio_clock.py).
TIME_TO_FIRST_AUDIO = _meter.create_histogram(
    "omni.audio.time_to_first_packet",
    unit="s",
    description="Request in until its first audio packet reaches the client, per output stage",
)
REAL_TIME_FACTOR = _meter.create_histogram(
    "omni.audio.real_time_factor",
    description="Time until a request's last audio packet over its audio's length (< 1: ahead)",
)
UNDERRUNS = _meter.create_counter(
    "omni.audio.underruns",
    description="Audio packets that came after the audio before them had finished playing",
)
