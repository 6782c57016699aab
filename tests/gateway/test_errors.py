"""Errors as OpenAI's clients see them, from a real gateway over a real mesh:
the HTTP status mapped from the mesh's gRPC code, OpenAI's JSON shape, and the
request's own field in ``param``; the SDK raises its matching exception."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from openai import OpenAI

from orchestrator.cli.processes import GatewayProcess
from services.gateway.errors import http_status
from services.mesh.security import SecuritySettings
from tests.gateway.conftest import MODEL, Mesh, mesh_over, tokens_file
from tests.orchestrator.conftest import Stages

HI = [{"role": "user", "content": "Hi"}]


def _sdk(mesh: Mesh, api_key: str = "anything") -> OpenAI:
    return OpenAI(base_url=mesh.base_url, api_key=api_key, max_retries=0, timeout=60)


async def _post(mesh: Mesh, body: object, **kwargs: object) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as http:
        return await http.post(f"{mesh.base_url}/chat/completions", json=body, **kwargs)


def _error(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize(
    ("code", "field", "status"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, "", 400),
        (grpc.StatusCode.UNAUTHENTICATED, "", 401),
        (grpc.StatusCode.PERMISSION_DENIED, "", 403),
        (grpc.StatusCode.NOT_FOUND, "", 404),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "", 504),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "request_id", 429),  # a full stage
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "submit", 413),  # a message too large
        (grpc.StatusCode.UNAVAILABLE, "", 503),
        (grpc.StatusCode.FAILED_PRECONDITION, "", 500),
        (grpc.StatusCode.INTERNAL, "", 500),
        (grpc.StatusCode.CANCELLED, "", 500),
    ],
)
def test_grpc_codes_map_to_http_statuses(code: grpc.StatusCode, field: str, status: int) -> None:
    assert http_status(code, field) == status


async def test_a_stage_refusal_is_a_400_naming_the_requests_field(mesh: Mesh) -> None:
    response = await _post(mesh, {"model": MODEL, "messages": HI, "temperature": -1})
    assert response.status_code == 400
    error = _error(response)
    assert error["param"] == "temperature" and error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_argument" and ">= 0" in error["message"]
    # The field is named as the request spelt it.
    response = await _post(mesh, {"model": MODEL, "messages": HI, "max_completion_tokens": 10**6})
    assert (response.status_code, _error(response)["param"]) == (400, "max_completion_tokens")
    # Streamed, a refusal before the first token is still an HTTP error.
    body = {"model": MODEL, "messages": HI, "temperature": -1, "stream": True}
    response = await _post(mesh, body)
    assert (response.status_code, _error(response)["param"]) == (400, "temperature")
    with pytest.raises(openai.BadRequestError) as refused:
        await asyncio.to_thread(
            lambda: _sdk(mesh).chat.completions.create(model=MODEL, messages=HI, temperature=-1)
        )
    assert refused.value.param == "temperature"


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        ({"n": 2}, "n", "only n=1 is supported"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "Input should"),
        (
            {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {}}]}]},
            "messages[0].content[0].type",
            "expected text, image_url or input_audio",
        ),
        ({"messages": []}, "messages", "at least 1 item"),
        ({"tools": [{"type": "function"}]}, "tools", "Extra inputs are not permitted"),
        ({"logprobs": True}, "logprobs", "not supported"),
        ({"seed": -1}, "seed", "greater than or equal to 0"),
    ],
)
async def test_requests_the_gateway_cannot_serve_are_400_naming_the_field(
    mesh: Mesh, extra: dict, param: str, says: str
) -> None:
    response = await _post(mesh, {"model": MODEL, "messages": HI, **extra})
    assert response.status_code == 400, response.text
    error = _error(response)
    assert error["param"] == param and says in error["message"], error


async def test_an_unknown_model_is_a_404(mesh: Mesh) -> None:
    response = await _post(mesh, {"model": "gpt-4o", "messages": HI})
    assert response.status_code == 404
    error = _error(response)
    assert (error["param"], error["code"]) == ("model", "model_not_found")
    assert MODEL in error["message"]
    with pytest.raises(openai.NotFoundError):
        await asyncio.to_thread(lambda: _sdk(mesh).models.retrieve("gpt-4o"))


async def test_bad_json_and_a_body_over_the_limit(mesh: Mesh) -> None:
    response = await _post(mesh, None, content=b"{not json", headers={"content-type": "x"})
    assert response.status_code == 400 and "not valid JSON" in _error(response)["message"]
    huge = {"model": MODEL, "messages": [{"role": "user", "content": "x" * (9 << 20)}]}
    response = await _post(mesh, huge)
    assert response.status_code == 413 and _error(response)["code"] == "body_too_large"
    # The gateway serves on.
    response = await _post(mesh, {"model": MODEL, "messages": HI, "max_tokens": 2})
    assert response.status_code == 200


@pytest.fixture(scope="module")
async def guarded(smollm2: Stages, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator:
    """The same stage behind an orchestrator that takes only known bearer tokens."""
    folder = tmp_path_factory.mktemp("guarded")
    path, token = tokens_file(folder)
    async with mesh_over(
        smollm2, folder, security=SecuritySettings(tokens_file=path), token=token
    ) as running:
        yield running, token


async def test_the_bearer_token_goes_through_to_the_orchestrator(guarded) -> None:
    mesh, token = guarded
    reply = await asyncio.to_thread(
        lambda: _sdk(mesh, token).chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 2
    listed = await asyncio.to_thread(lambda: _sdk(mesh, token).models.list())
    assert [m.id for m in listed] == [MODEL]
    # The gateway knows the model now; every call still takes the caller's token.
    for api_key in ("not-a-known-token", token[:-1]):
        sdk = _sdk(mesh, api_key)
        for call in (
            partial(sdk.chat.completions.create, model=MODEL, messages=HI, max_tokens=2),
            partial(sdk.chat.completions.create, model=MODEL, messages=HI, stream=True),
            sdk.models.list,
        ):
            with pytest.raises(openai.AuthenticationError):
                await asyncio.to_thread(call)
    response = await _post(mesh, {"model": MODEL, "messages": HI})  # no Authorization at all
    assert response.status_code == 401 and _error(response)["code"] == "unauthenticated"
    response = await _post(mesh, {"model": MODEL, "messages": HI}, headers={"authorization": "x"})
    assert response.status_code == 401 and _error(response)["code"] == "invalid_api_key"


async def test_probes_and_an_orchestrator_that_is_not_there(mesh: Mesh, tmp_path: Path) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        assert (await http.get(f"{mesh.root}/health")).json() == {"status": "ok"}
        ready = await http.get(f"{mesh.root}/ready")
        assert (ready.status_code, ready.json()) == (200, {"ready": True})
        with (tmp_path / "gateway.log").open("ab") as log:
            alone = GatewayProcess("127.0.0.1:1", log=log)
            await alone.start()
        try:
            root = f"http://{alone.address}"
            assert (await http.get(f"{root}/health")).status_code == 200
            assert (await http.get(f"{root}/ready")).status_code == 503
            body = {"model": MODEL, "messages": HI}
            response = await http.post(f"{root}/v1/chat/completions", json=body)
            assert response.status_code == 503
            assert _error(response)["code"] == "unavailable"
        finally:
            assert await alone.stop() == 0  # SIGTERM: a clean exit
