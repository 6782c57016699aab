"""The gateway's listening socket: connections served from it send small writes at
once (TCP_NODELAY), or every SSE chunk after the first waits out the client's
delayed ACK (~40 ms a response, measured by benchmarks/gateway.py)."""

from __future__ import annotations

import asyncio
import socket

from services.gateway.__main__ import _listen


async def test_connections_from_the_listener_send_without_delay() -> None:
    listener = _listen("127.0.0.1", 0)
    nodelay: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        nodelay.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(connected, sock=listener)  # as uvicorn serves it
    try:
        port = listener.getsockname()[1]
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(nodelay, 10) != 0
        writer.close()
    finally:
        server.close()
        await server.wait_closed()
