"""The gateway's FastAPI application: OpenAI's routes over one orchestrator
client (opened with the app, closed with it), probes, and errors in OpenAI's
shape. Each call carries its caller's bearer token to the orchestrator."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Protocol, TypeVar

import grpc
from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from orchestrator.client import AsyncClient, Events, Result
from services.gateway import chat, images, speech, transcribe
from services.gateway.audio_out import Speech, chat_speech, speech_stage
from services.gateway.catalog import Catalog
from services.gateway.config import GatewayConfig
from services.gateway.errors import ApiError
from services.gateway.http_io import bearer_token, cancelled_on_disconnect, read_body
from services.gateway.realtime.endpoint import Sessions
from services.gateway.realtime.session import Context
from services.gateway.schema import ChatRequest, ImageRequest, SpeechRequest, parse
from services.gateway.voices import Voices
from services.mesh.pb.omni.v1 import orchestrator_pb2

logger = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # what nginx logs for a client gone before its answer
B = TypeVar("B", bound=BaseModel)


class Gateway:
    """What the routes share: the orchestrator client and what it told us."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.client = AsyncClient(config.orchestrator, config.dialing)
        self.catalog = Catalog(self.client)
        self.started = int(time.time())
        self.voices = Voices(config.voice_aliases)
        self.sessions = Sessions(Context(self.client, config.realtime, self.voices), self.catalog)


def create_app(config: GatewayConfig) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        gateway = Gateway(config)
        app.state.gateway = gateway
        try:
            yield
        finally:
            await gateway.client.close()

    app = FastAPI(title="Omni Mesh gateway", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body, status_code=exc.status)

    @app.exception_handler(ClientGone)
    async def client_gone(_request: Request, exc: ClientGone) -> Response:
        # Nobody reads it; logs show 499, as nginx's do for a client gone first.
        logger.info("request %s: the client went away; cancelled in the mesh", exc.request_id)
        return Response(status_code=CLIENT_CLOSED)

    @app.exception_handler(grpc.aio.AioRpcError)
    async def rpc_error(_request: Request, exc: grpc.aio.AioRpcError) -> JSONResponse:
        error = ApiError.from_rpc(exc)
        return JSONResponse(error.body, status_code=error.status)

    @app.get("/health")
    async def health() -> dict[str, str]:
        """Liveness: the process serves HTTP."""
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(request: Request) -> JSONResponse:
        """Readiness: the orchestrator serves (every stage READY)."""
        try:
            serving = await _gateway(request).client.serving()
        except grpc.aio.AioRpcError:
            serving = False
        return JSONResponse({"ready": serving}, status_code=200 if serving else 503)

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, object]:
        gateway = _gateway(request)
        pipeline = await gateway.catalog.fresh(bearer_token(request))
        return {"object": "list", "data": [pipeline.card(gateway.started)]}

    @app.get("/v1/models/{model}")
    async def get_model(model: str, request: Request) -> dict[str, object]:
        gateway = _gateway(request)
        pipeline = await gateway.catalog.fresh(bearer_token(request))
        pipeline.check_model(model)
        return pipeline.card(gateway.started)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        gateway, body, token = await _intake(request, ChatRequest)
        pipeline = await gateway.catalog.model(body.model, token)
        generate, fields = chat.generate_request(body)
        await transcribe.spoken_parts_as_text(gateway.client, token, pipeline, generate)
        speech = chat_speech(body, pipeline, generate, fields, gateway.voices)
        generate.outputs.extend(pipeline.outputs(audio=speech is not None))
        events = gateway.client.send(generate, token=token)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            stream = chat.ChunkStream(
                generate.request_id,
                pipeline.name,
                fields,
                include_usage=include_usage,
                speech=speech,
            )
            return await _streamed(request, events, stream.sse, fields)
        answer = chat.Answer(speech=speech)
        await _gather(request, events, answer, fields)
        return JSONResponse(
            chat.completion(generate.request_id, pipeline.name, answer, body.audio_format)
        )

    @app.post("/v1/images/generations")
    async def images_generations(request: Request) -> Response:
        gateway, body, token = await _intake(request, ImageRequest)
        pipeline = await gateway.catalog.model(body.model, token)
        stage = images.image_stage(pipeline)
        generate, fields = images.generate_request(body, stage)
        generate.outputs.extend(pipeline.outputs(image=True))
        result = Result()
        await _gather(request, gateway.client.send(generate, token=token), result, fields)
        return JSONResponse(images.images_response(result, stage))

    @app.post("/v1/audio/speech")
    async def audio_speech(request: Request) -> Response:
        gateway, body, token = await _intake(request, SpeechRequest)
        stage = speech_stage(await gateway.catalog.model(body.model, token), "model")
        generate, fields = speech.generate_request(body, stage, gateway.voices)
        events = gateway.client.send(generate, token=token)
        said = Speech(stage)
        media_type = speech.MEDIA_TYPES[body.response_format]
        if body.response_format == "pcm":
            return await _streamed(request, events, speech.pcm_stream(said), fields, media_type)
        await _gather(request, events, said, fields)
        return Response(said.wav(), media_type=media_type)

    @app.post("/v1/audio/transcriptions", response_model=None)
    async def audio_transcriptions(request: Request) -> Response:
        """Speech to text by the pipeline's recogniser stage (transcribe.py)."""
        gateway = _gateway(request)
        token = bearer_token(request)
        upload = await transcribe.read_form(request, gateway.config.max_body_bytes)
        stage = transcribe.recogniser_stage(await gateway.catalog.model(None, token), upload.model)
        generate = transcribe.request(stage, upload.audio, upload.language, upload.prompt)
        fields = {"inputs.messages[0].parts[0]": "file", "params.extra.language": "language"}
        fields["params.extra.prompt"] = "prompt"
        said = await transcribe.transcribe(gateway.client, token, generate, fields)
        body = transcribe.response_body(said, upload.response_format, upload.language)
        if isinstance(body, str):
            return Response(body, media_type="text/plain; charset=utf-8")
        return JSONResponse(body)

    @app.get("/v1/audio/voices")
    async def audio_voices(request: Request) -> dict[str, object]:
        """The speech stage's voices (the first its default) and the aliases."""
        gateway = _gateway(request)
        pipeline = await gateway.catalog.model(None, bearer_token(request))
        return gateway.voices.listing(pipeline.voices)

    @app.websocket("/v1/realtime")
    async def realtime(websocket: WebSocket) -> None:
        """The OpenAI Realtime API: a session per WebSocket (realtime/)."""
        await websocket.app.state.gateway.sessions.serve(websocket)

    return app


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


async def _intake(request: Request, schema: type[B]) -> tuple[Gateway, B, str | None]:
    """What every POST starts with: the body (within the limit) as ``schema``, and
    the caller's token."""
    gateway = _gateway(request)
    body = parse(schema, await read_body(request, gateway.config.max_body_bytes))
    return gateway, body, bearer_token(request)


class _Gathers(Protocol):
    done: orchestrator_pb2.Done | None

    def add(self, event: orchestrator_pb2.GenerateEvent) -> object: ...


class ClientGone(Exception):
    """The client disconnected before its answer: its request was cancelled."""

    def __init__(self, request_id: str) -> None:
        super().__init__(request_id)
        self.request_id = request_id


async def _gather(request: Request, events: Events, into: _Gathers, fields: dict[str, str]) -> None:
    """Every event of the request into ``into``; its failure raised as an ApiError."""
    async with cancelled_on_disconnect(request, events.cancel) as disconnected:
        try:
            async for event in events:
                into.add(event)
        except grpc.aio.AioRpcError:
            if disconnected():
                raise ClientGone(events.request_id) from None
            raise
    _raise_failed(into.done, fields)


def _raise_failed(done: orchestrator_pb2.Done | None, fields: dict[str, str]) -> None:
    if done is None:
        raise ApiError(502, "the orchestrator ended the request without a status")
    if done.code != 0:
        logger.info("request %s: %s %s", done.request_id, done.code_name, done.message)
        raise ApiError.from_done(done, fields)


async def _streamed(
    request: Request,
    events: Events,
    body: Callable[[AsyncIterator[orchestrator_pb2.GenerateEvent]], AsyncIterator[bytes]],
    fields: dict[str, str],
    media_type: str = "text/event-stream",
) -> Response:
    """A refusal before the first event is an HTTP error (the SDKs raise it at
    once); after it, the answer streams (``body`` makes it of the events). Once
    streaming, a client that goes away cancels the stream's task, and with it the
    call."""
    iterator = aiter(events)
    async with cancelled_on_disconnect(request, events.cancel) as disconnected:
        try:
            first = await anext(iterator)
        except grpc.aio.AioRpcError:
            if disconnected():
                raise ClientGone(events.request_id) from None
            raise
    if first.WhichOneof("kind") == "done":
        _raise_failed(first.done, fields)

    async def chained() -> AsyncIterator[orchestrator_pb2.GenerateEvent]:
        try:
            yield first
            async for event in iterator:
                yield event
        finally:
            events.cancel()  # a no-op once the call has ended

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(body(chained()), media_type=media_type, headers=headers)
