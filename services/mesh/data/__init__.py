"""The tensor data plane's torch-free half: everything the orchestrator needs to
route, chunk and read tensors without importing torch (an import-linter contract
in pyproject.toml holds this).

    wire.py         dtype names and sizes, byte sizes, joining inline pieces
    chunk_wire.py   TensorChunk frames of Generate encoded and read by hand
    chunks.py       large inline tensors and blobs as chunks, and their assembly
    media_wire.py   a chat's media (content parts) chunked and put back like tensors
    byte_budget.py  input held in memory: a cap per stream and per process
    node.py         node identity (boot, namespaces, GPUs) and the mesh id
    shm_names.py    what a shared block's name says: mesh, producer, request, secret
    shm_dir.py      the mesh's private /dev/shm directory, producers' locks, the sweep
    shm_refs.py     checking a ref and opening its block (for its own request only)
    shm_pool.py     pre-faulted shared blocks reused across requests
    ref_reader.py   a tensor ref's bytes, for a process that hands them to a client
    malloc.py       glibc's malloc set up to keep large freed buffers warm

The torch half (tensors in shared memory, CUDA IPC, the transport choice) is
``services.mesh.tensors``.
"""
