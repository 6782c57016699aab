"""The orchestrator side, in three packages:

``server/``  the Orchestrator process: pipeline file, stage monitors, request router,
             KEDA scaler, gRPC service (``omni orchestrator serve``)
``client/``  the Python client library: ``AsyncClient``, ``Client``, content parts
``cli/``     the ``omni`` command, and ``omni up``'s launcher of local processes
``examples/`` the stage and pipeline files shipped in the wheel

The CLI sits on both others; the server and the client never import each other or
the CLI (import-linter contracts in pyproject.toml). None of it imports stage or
engine code: it talks to stages only through the contract in protos/ (services.mesh).
"""
