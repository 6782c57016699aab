"""The tensor data plane's torch half, for stages: tensors to and from the wire.

    codec.py      torch.Tensor <-> omni.v1.Tensor (inline bytes)
    shm.py        tensors in POSIX shared memory: producer and consumer
    cuda_ipc.py   CUDA tensors handed between processes of one node
    transport.py  the cheapest way a tensor reaches its consumer, both ends

What needs no torch (wire format, chunks, block refs, node identity) is
``services.mesh.data``.
"""
