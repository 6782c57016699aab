"""What every mesh process shares, one subpackage per concern:

    pb/          the generated protobuf and gRPC stubs of protos/ (the contract)
    rpc/         gRPC plumbing: the server builder, decoding, health port, stage client
    data/        the tensor data plane without torch: wire format, chunks, shm refs, node
    tensors/     the tensor data plane with torch: codec, shm, CUDA IPC, transport
    security/    TLS, tokens, the auth interceptor, dialing, a throwaway CA
    telemetry/   OpenTelemetry tracing and metrics, off unless configured

and, at this level, what every layer uses:

    errors.py        domain exceptions that carry their gRPC status, mapped in one place
    config_files.py  YAML config files read into frozen pydantic models, errors that name
                     file and key; the ``Frozen`` base every config model derives from
    environment.py   every OMNI_* environment variable, read in one place
    process.py       process helpers: logging, signals, death with the parent, binding
    media_types.py   the media types a chat content part may carry; a file's type

Nothing here imports the stage, the engines or the orchestrator, and ``data/``
never imports torch (import-linter contracts in pyproject.toml).
"""
