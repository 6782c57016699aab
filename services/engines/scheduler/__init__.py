"""The scheduler every generating engine runs under: admission, waiting, gathering,
prefill / mixed / decode planning, retiring, cancellation and delivery, knowing no
model (scheduler.py); what it asks of a request and of a model runner, and what a
step hands a request (contract.py); when an idle scheduler stops gathering newcomers
(arrivals.py); the one thread that owns a model, which code2wav's and the diffusers
engine's batches run on too (worker.py); a request's deliveries to the event loop,
whole or window by window (inbox.py), posted from the model thread with one wake for
many (loop_post.py); and what every engine under it shares (shell.py)."""

from __future__ import annotations

from services.engines.scheduler.contract import (
    Delivery,
    Handed,
    ModelRunner,
    Outbox,
    Scheduled,
    Step,
    StepTaken,
    Windowed,
    WindowEnd,
)
from services.engines.scheduler.inbox import Inbox
from services.engines.scheduler.scheduler import Limits, Scheduler
from services.engines.scheduler.shell import EngineShell
from services.engines.scheduler.worker import Worker

__all__ = [
    "Delivery",
    "EngineShell",
    "Handed",
    "Inbox",
    "Limits",
    "ModelRunner",
    "Outbox",
    "Scheduled",
    "Scheduler",
    "Step",
    "StepTaken",
    "WindowEnd",
    "Windowed",
    "Worker",
]
