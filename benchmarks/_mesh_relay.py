"""The floor under the orchestrator's first hop: a bare grpc.aio server that
serves ``Orchestrator.Generate`` by forwarding each request to one stage on a
Generate stream of its own and each output back as an event, and nothing else
(no interceptors, router, windows, credit, telemetry, health or checks).

    python -m benchmarks._mesh_relay --stage HOST:PORT [--host H] [--port P]

It prints ``listening HOST:PORT`` once bound (``RelayProcess`` starts it as
a child, as the orchestrator is started); benchmarks/mesh_overhead.py times
it beside the orchestrator over the same stage, in the same rounds, so the
part of a hop that is Python gRPC aio itself (two servers' worth of HTTP/2
and protobuf on one event loop) is visible next to what is ours.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from orchestrator.cli.processes import ServiceProcess
from services.mesh.pb.omni.v1 import (
    orchestrator_pb2,
    orchestrator_pb2_grpc,
    stage_pb2,
    stage_pb2_grpc,
)
from services.mesh.rpc.server import SERVER_KEEPALIVE_OPTIONS

_FINAL = ("completed", "error")


class Relay(orchestrator_pb2_grpc.OrchestratorServicer):
    def __init__(self, stage_address: str, stage: str) -> None:
        self._channel = grpc.aio.insecure_channel(stage_address)
        self._stub = stage_pb2_grpc.StageStub(self._channel)
        self._stage = stage

    async def Generate(
        self, request: orchestrator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[orchestrator_pb2.GenerateEvent]:
        submit = stage_pb2.Submit(
            request_id=request.request_id,
            inputs=request.inputs,
            params=request.params,
            is_last=True,
        )
        call = self._stub.Generate()
        try:
            await call.write(stage_pb2.StageInput(submit=submit))
            await call.done_writing()
            async for output in call:
                kind = output.WhichOneof("kind")
                event = orchestrator_pb2.GenerateEvent(stage=self._stage)
                getattr(event, kind).CopyFrom(getattr(output, kind))
                yield event
                if kind in _FINAL:
                    break
        finally:
            call.cancel()
        yield orchestrator_pb2.GenerateEvent(
            done=orchestrator_pb2.Done(request_id=request.request_id, code_name="OK")
        )

    async def close(self) -> None:
        await self._channel.close()


class RelayProcess(ServiceProcess):
    """``python -m benchmarks._mesh_relay``: the relay over one stage, as a child."""

    def __init__(self, stage_address: str, stage: str, **kwargs: Any) -> None:
        super().__init__(Path(f"relay to {stage}"), **kwargs)
        self.stage_address = stage_address
        self.stage = stage

    def command(self) -> list[str]:
        module = [sys.executable, "-m", "benchmarks._mesh_relay"]
        return [*module, "--stage", self.stage_address, "--name", self.stage]


async def serve(stage_address: str, stage: str, host: str, port: int) -> None:
    # The mesh's keepalive settings (options, nothing per request): its clients ping.
    server = grpc.aio.server(options=SERVER_KEEPALIVE_OPTIONS)
    relay = Relay(stage_address, stage)
    orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(relay, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    print(f"listening {host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1.0)
    await relay.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", required=True, help="the stage's address")
    parser.add_argument("--name", default="s1", help="the stage's name in the events")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    asyncio.run(serve(args.stage, args.name, args.host, args.port))


if __name__ == "__main__":
    main()
