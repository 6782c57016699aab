"""gRPC plumbing shared by both servers and their clients, torch-free.

    server.py       MeshServer, the one server builder: keepalive, message limits,
                    interceptors, reflection, health and the plaintext probe port
                    (--health-port); both the stage and the orchestrator use it
    decoding.py     a frame that does not decode ends the RPC with INVALID_ARGUMENT
    stage_client.py StageClient: the asyncio client of one Stage service
    request_ids.py  what a request id may be, checked alike everywhere

The error vocabulary they map to status codes is ``services.mesh.errors``.
"""
