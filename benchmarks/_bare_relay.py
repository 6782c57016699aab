"""The floor under the gateway (benchmarks/gateway.py): a bare ASGI app on the
same server stack (uvicorn, httptools, uvloop) that relays one chat request to
the orchestrator's Generate and answers with the least it can (the text as one
JSON object, or one SSE line per segment). No FastAPI, no validation, no
OpenAI shapes, no disconnect watch: what is left is HTTP, ASGI and one gRPC call.

    python benchmarks/_bare_relay.py --orchestrator HOST:PORT [--port 0]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
from typing import Any

import orjson
import uvicorn
import uvloop

from orchestrator.client import AsyncClient, make_request

Scope = dict[str, Any]


def relay(client: AsyncClient) -> Any:
    async def app(scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = orjson.loads(body)
        prompt = request["messages"][-1]["content"]
        params = {"max_tokens": request["max_tokens"], "temperature": 0.0}
        events = client.send(make_request(prompt, params=params))
        stream = request.get("stream", False)
        content = b"text/event-stream" if stream else b"application/json"
        if stream:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", content)],
                }
            )
        texts, tokens = [], 0
        async for event in events:
            if event.WhichOneof("kind") == "segment":
                tokens += len(event.segment.token_ids)
                texts.append(event.segment.text_delta)
                if stream:
                    line = b"data: " + orjson.dumps({"t": event.segment.text_delta}) + b"\n\n"
                    await send({"type": "http.response.body", "body": line, "more_body": True})
        usage = {"usage": {"completion_tokens": tokens}}
        if stream:
            end = b"data: " + orjson.dumps(usage) + b"\n\ndata: [DONE]\n\n"
            await send({"type": "http.response.body", "body": end})
            return
        answer = orjson.dumps({"text": "".join(texts), **usage})
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", content)]}
        )
        await send({"type": "http.response.body", "body": answer})

    return app


async def serve(orchestrator: str, host: str, port: int) -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(2048)
    async with AsyncClient(orchestrator) as client:
        config = uvicorn.Config(relay(client), log_config=None, access_log=False, http="httptools")
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve(sockets=[listener]))
        print(f"listening {host}:{listener.getsockname()[1]}", flush=True)
        await task


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--orchestrator", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    uvloop.run(serve(args.orchestrator, args.host, args.port))


if __name__ == "__main__":
    main()
