"""StageClient.generate sends a request again when its call fails UNAVAILABLE before
any event of it arrived (the replica it went to is going away), never after: real
gRPC servers on 127.0.0.1 playing a replica that fails each call it gets, one that
answers once and then fails, and one that refuses with another status."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc
import pytest

from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.rpc.stage_client import GENERATE, GENERATE_ATTEMPTS, StageClient, chat_submit


class Failing:
    """A Generate that reads the request, then (after ``answers`` events) ends the
    call with ``code``; counts the calls it got."""

    def __init__(self, code: grpc.StatusCode, answers: int = 0) -> None:
        self.code, self.answers, self.calls = code, answers, 0

    async def generate(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        self.calls += 1
        async for _ in requests:
            break
        for n in range(self.answers):
            segment = stage_pb2.Segment(request_id="r", sequence=n, token_ids=[n])
            yield stage_pb2.StageOutput(segment=segment).SerializeToString()
        await context.abort(self.code, "this replica is going away")


async def _serve(failing: Failing) -> tuple[grpc.aio.Server, str]:
    ident: Callable[[bytes], bytes] = lambda b: b  # noqa: E731
    handler = grpc.stream_stream_rpc_method_handler(
        failing.generate, request_deserializer=ident, response_serializer=ident
    )
    service, method = GENERATE.strip("/").split("/")
    server = grpc.aio.server()
    generic = grpc.method_handlers_generic_handler(service, {method: handler})
    server.add_generic_rpc_handlers((generic,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.mark.parametrize(
    ("code", "answers", "calls"),
    [
        (grpc.StatusCode.UNAVAILABLE, 0, GENERATE_ATTEMPTS),  # tried again, then its error
        (grpc.StatusCode.UNAVAILABLE, 1, 1),  # an event arrived: never sent again
        (grpc.StatusCode.INVALID_ARGUMENT, 0, 1),  # a refusal, not a dead replica
    ],
)
async def test_a_call_goes_again_only_while_nothing_of_it_arrived(
    code: grpc.StatusCode, answers: int, calls: int
) -> None:
    failing = Failing(code, answers)
    server, address = await _serve(failing)
    try:
        async with StageClient(address) as client:
            got: list[stage_pb2.StageOutput] = []
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                async for output in client.generate(chat_submit("r", "Hello")):
                    got.append(output)
            assert raised.value.code() == code
            assert "going away" in (raised.value.details() or "")
            assert len(got) == answers and failing.calls == calls
    finally:
        await server.stop(None)
