"""The Python client library of the Orchestrator service.

``clients``  AsyncClient and Client: Generate, GenerateStream, Abort, stages
``requests`` a request as the service takes it (make_request, stream_inputs)
``results``  what a request returned, by stage (Result)
``content``  chat content parts: text, images, audio, video, from bytes or files
``audio``    a request's audio written as it arrives, one WAV file per stage
``targets``  where a client dials: one orchestrator or several, a call tried again

It never imports the server or the CLI (import-linter), so a program that only asks
a mesh imports no server code.
"""

from orchestrator.client.clients import DEFAULT_ADDRESS, AsyncClient, Client, Events
from orchestrator.client.requests import make_request, stream_inputs
from orchestrator.client.results import Result, StageResult

__all__ = [
    "DEFAULT_ADDRESS",
    "AsyncClient",
    "Client",
    "Events",
    "Result",
    "StageResult",
    "make_request",
    "stream_inputs",
]
