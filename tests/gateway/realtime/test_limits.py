"""The gateway's limits on realtime sessions, each answered with an ``error``
event and a close code, never a crash: sessions at once (1013), idle sessions
(1001), a client that stops reading (1008, with the gateway's memory bounded
while it floods), a message over the size limit (1009). A second gateway with
strict limits runs beside the module's, over the same orchestrator."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import websockets
from websockets.asyncio.client import ClientConnection

from orchestrator.cli.processes import GatewayProcess
from tests.gateway.conftest import MODEL, Mesh
from tests.helpers.polling import eventually
from tests.helpers.stalled_ws import StalledClient, frames

UNREAD = 1 << 20


@dataclass
class Strict:
    url: str
    process: psutil.Process
    log: Path


@pytest.fixture(scope="module")
async def strict_gateway(
    speaking: Mesh, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Strict]:
    """A gateway allowing 2 sessions, idle for 1 s, 1 MiB unread, 256 KiB events."""
    args = ["--max-sessions", "2", "--session-idle-s", "1", "--max-unread-bytes", str(UNREAD),
            "--max-event-bytes", str(256 << 10)]  # fmt: skip
    log_path = tmp_path_factory.mktemp("strict") / "gateway.log"
    with log_path.open("ab") as log:
        gateway = GatewayProcess(speaking.gateway.orchestrator, args=args, log=log)
        address = await gateway.start()
        try:
            url = f"ws://{address}/v1/realtime?model={MODEL}"
            yield Strict(url, psutil.Process(gateway.pid), log_path)
        finally:
            await gateway.stop(5)


@pytest.fixture
def strict(strict_gateway: Strict) -> str:
    return strict_gateway.url


def _connect(url: str, **kwargs: Any) -> Any:
    return websockets.connect(url, additional_headers={"Authorization": "Bearer x"}, **kwargs)


async def _next(ws: ClientConnection, kind: str) -> dict[str, Any]:
    while True:
        event = json.loads(await asyncio.wait_for(ws.recv(), 30))
        if event["type"] == kind:
            return event


async def _closed(ws: ClientConnection) -> tuple[list[dict[str, Any]], int | None, str]:
    """What the session sends until the gateway closes it, and the close code."""
    events = []
    with pytest.raises(websockets.ConnectionClosed):
        while True:
            events.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
    assert ws.close_code is not None
    return events, ws.close_code, ws.close_reason or ""


async def test_sessions_past_max_sessions_are_closed_1013(strict: str) -> None:
    async with _connect(strict) as first, _connect(strict) as second:
        await _next(first, "session.created")
        await _next(second, "session.created")
        async with _connect(strict) as third:
            events, code, reason = await _closed(third)
        assert code == 1013 and reason == "session_limit_reached"
        assert [e["error"]["code"] for e in events] == ["session_limit_reached"]
        await first.close()
    async with _connect(strict) as again:  # a place is free again
        assert (await _next(again, "session.created"))["session"]["model"] == MODEL


async def test_an_idle_session_is_closed_1001(strict: str) -> None:
    async with _connect(strict) as ws:
        events, code, reason = await _closed(ws)
    assert events[0]["type"] == "session.created"
    assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "session_idle_timeout"
    assert (code, reason) == (1001, "session_idle_timeout")


async def test_a_message_over_the_size_limit_is_closed_1009(strict: str) -> None:
    async with _connect(strict, max_size=None) as ws:
        await _next(ws, "session.created")
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": "A" * (300 << 10)}))
        _events, code, _reason = await _closed(ws)
    assert code == 1009


async def test_a_client_that_stops_reading_is_closed_1008_and_costs_bounded_memory(
    strict_gateway: Strict,
) -> None:
    """It floods the session with items whose echoes it never reads: the gateway
    queues at most --max-unread-bytes of them, then ends the session."""
    gateway = strict_gateway.process
    host, port = strict_gateway.url.removeprefix("ws://").split("/")[0].split(":")
    before = gateway.memory_info().rss
    peak = before
    text = "wave " * (20 << 10)  # 100 KiB: echoed twice (item added, done) per item
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    event = json.dumps({"type": "conversation.item.create", "item": item})
    client = await asyncio.to_thread(StalledClient, host, int(port), f"/v1/realtime?model={MODEL}")
    try:
        sent = await asyncio.to_thread(_flood, client, event, 400)

        async def told() -> bool:
            nonlocal peak
            peak = max(peak, gateway.memory_info().rss)
            return "the client stopped reading" in strict_gateway.log.read_text()

        await eventually(told, 60, message="the gateway never ended the stalled session")
        data = await asyncio.to_thread(client.read_all)  # it reads again: it is told why
    finally:
        client.close()
    received = frames(data)
    opcode, payload = received[-1]
    assert opcode == 8 and int.from_bytes(payload[:2], "big") == 1008, received[-1]
    assert payload[2:] == b"client_too_slow"
    last = json.loads(received[-2][1])
    assert last["type"] == "error" and last["error"]["code"] == "client_too_slow"
    assert sent < 400  # the session was ended, not served to the end
    grown = (peak - before) / (1 << 20)
    assert grown < 64, f"the gateway grew {grown:.0f} MiB for a client that stopped reading"
    # The gateway serves on, and gives the memory back.
    async with _connect(strict_gateway.url) as ws:
        await _next(ws, "session.created")

    async def gave_back() -> bool:
        return _rss(gateway) < before + (32 << 20)

    await eventually(gave_back, 30, message=lambda: f"gateway RSS {_rss(gateway) >> 20} MiB")


def _flood(client: StalledClient, event: str, count: int) -> int:
    """Send up to ``count`` events; fewer once the gateway stops reading (it ended the session)."""
    client.sock.settimeout(5)
    for sent in range(count):
        try:
            client.send_text(event)
        except OSError:
            return sent
    return count


def _rss(process: psutil.Process) -> int:
    return int(process.memory_info().rss)
