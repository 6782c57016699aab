"""A consumer engine for tests (``engine: "tests.helpers.echo_tensors:EchoTensorsEngine"``):
it emits the tensors it received, unchanged and under their own names, and reports
the rows of the first one as ``prompt_tokens``. What a client gets back is
exactly what the stage was handed, however it travelled."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import ClassVar

from services.engines.base import EngineEvent, EnginePlan, FinishOutput, TensorOutput
from services.testing.fake_engine import FakeEngine


class EchoTensorsEngine(FakeEngine):
    description: ClassVar[str] = "echoes its input tensors"
    name: ClassVar[str] = "echo_tensors"
    supported_params: ClassVar[frozenset[str]] = frozenset()
    output_tensors: ClassVar[tuple[str, ...]] = ("frames",)

    async def generate(self, plan: EnginePlan) -> AsyncGenerator[EngineEvent, None]:
        request = plan.request
        # A copy: the inputs map the producer's blocks, which are reused once released.
        yield TensorOutput({name: t.clone() for name, t in request.tensors.items()})
        rows = next((int(t.shape[0]) for t in request.tensors.values() if t.dim()), 0)
        yield FinishOutput("done", prompt_tokens=rows)
