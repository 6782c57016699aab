"""The HTTP front door: an OpenAI-compatible API in front of the orchestrator's
gRPC, its own process (``omni gateway``; ``omni up --http PORT`` starts one).
It is a client of the orchestrator like any other (orchestrator.client over
gRPC): it never imports torch, the engines or the stage (import-linter).

    config.py    GatewayConfig: where the orchestrator is, how to dial it, limits
    schema.py    the OpenAI request bodies it accepts, validated once at the edge
    errors.py    ApiError: OpenAI's error shape; gRPC status to HTTP in one function
    catalog.py   the pipeline as a model (/v1/models), learnt from ListStages
    chat.py      /v1/chat/completions: messages to a GenerateRequest, events to
                 a completion or to server-sent chunks
    images.py    /v1/images/generations: a diffusion stage's PNG as b64_json
    audio_out.py a speech stage's audio segments as WAV or PCM: chat's
                 message.audio and delta.audio pieces
    speech.py    /v1/audio/speech: the input spoken by the speech stage alone
    http_io.py   the HTTP side of a call: body limit, bearer token, disconnects
    app.py       the FastAPI application: routes, probes, the orchestrator client
"""
