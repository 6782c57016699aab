"""The stage service: one model (an engine) behind the Stage gRPC service.

    __main__.py  ``python -m services.stage serve --config FILE``
    config.py    the stage file, validated once into frozen models
    server.py    StageServer: the gRPC server, health, start-up task, drain
    startup/     fetch, device lock, load, memory plan, warm-up: the init phases
    serving/     the request path: Generate frames in, engine, events out

The stage never imports the orchestrator (an import-linter contract).
"""
