"""Admission: how many requests a stage holds at once, counted.

The engine batches: its step loop runs up to ``runtime.max_batch_size`` requests
together and keeps the rest waiting in its own queue. So the stage does not queue
again; it holds up to ``max_batch_size + max_queue_size`` requests and refuses
one more at once with RESOURCE_EXHAUSTED, naming both settings.
"""

from __future__ import annotations

from services.mesh.errors import ResourceExhausted


class Admission:
    def __init__(self, stage: str, max_batch_size: int, max_queue_size: int) -> None:
        self.stage = stage
        self.max_batch_size = max_batch_size
        self.max_queue_size = max_queue_size
        self.held = 0

    @property
    def limit(self) -> int:
        return self.max_batch_size + self.max_queue_size

    def enter(self, request_id: str) -> None:
        """Count ``request_id`` in (``leave`` counts it out); refused when the stage is full."""
        if self.held >= self.limit:
            raise ResourceExhausted(
                f"request {request_id}: stage {self.stage} is full: {self.held} requests, "
                f"up to {self.max_batch_size} running (runtime.max_batch_size) and "
                f"{self.max_queue_size} waiting (runtime.max_queue_size)",
                field="request_id",
            )
        self.held += 1

    def leave(self) -> None:
        self.held -= 1
