"""The pipeline file's ``runtime:`` section: what the orchestrator lets its clients
hold, validated once with the rest of the file (docs/configuration.md, "The
pipeline file").

Every byte a client sends is held somewhere before it leaves for a stage: a
unary Generate's message while it is read and while its request runs, chunks of
a GenerateStream until their tensor's message comes, windows until the entry
stage's stream takes them. All of it counts against ``max_process_input_bytes``
(``services/mesh/data/byte_budget.py``); a unary message is reserved at
``max_message_bytes`` before it is read (``services/mesh/rpc/reads.py``), so the
process budget admits ``max_process_input_bytes // max_message_bytes`` such
reads at once, and a message waiting for its turn stays at the sender (the
server does no BDP probing: a stream's window opens for the message being read).

What the process holds at its peak is therefore the budget plus the one message
being taken in at that moment, in up to four copies (gRPC's received slices and
their join, Python's bytes, the parsed message; a wave's peak is in
docs/benchmarks.md). Once its Submit is built the request
drops the parsed message, and the Submit goes once sent, so a relayed input is
not held while its request runs; every copy is freed when it is done with (no
traceback keeps one: ``errors.forget``), and the freed memory goes back to the
system once the burst is over (``services/mesh/data/malloc.py``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.mesh.rpc.limits import ConnectionLimits


class OrchestratorRuntime(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # The largest client message (gRPC's receive limit: a larger one is refused
    # RESOURCE_EXHAUSTED before it is read). Larger inputs go as GenerateStream chunks.
    max_message_bytes: int = Field(64 << 20, ge=4096)
    # Chunked input and waiting windows one GenerateStream may hold at once.
    max_input_bytes: int = Field(256 << 20, ge=4096)
    # Client input the whole process holds at once: unary messages, chunks, windows.
    max_process_input_bytes: int = Field(1 << 30, ge=4096)
    # A request that needs a stage which is not READY (DOWN, or restarting) waits up
    # to this long for it (never past its own deadline), then is refused UNAVAILABLE
    # naming the stage and its state; a FAILED stage refuses at once.
    ready_wait_s: float = Field(30.0, ge=0)
    # Connections, streams, idle and first-message timeouts (services/mesh/rpc/limits.py).
    connections: ConnectionLimits = ConnectionLimits()

    @model_validator(mode="after")
    def _one_message_fits(self) -> OrchestratorRuntime:
        if self.max_process_input_bytes < self.max_message_bytes:
            raise ValueError(
                "max_process_input_bytes: expected at least max_message_bytes "
                f"({self.max_message_bytes}): each unary message is reserved at that size"
            )
        return self
