"""A running stage's request path, in the order a request meets it:

    generate_rpc.py  one Generate stream: Submits, chunks and Cancels in, events out
    frames.py        one Generate frame read (chunks by hand)
    convert.py       proto <-> domain: request ids, sizes, parameters
    inputs.py        decode, and join pieces/windows into whole tensors
    transforms.py    input processors on whole inputs (named in Describe)
    requests.py      the one registry of requests in flight
    admission.py     how many requests the stage holds: a counter
    runtime.py       start, engine drive, segmenting, the final event
    events.py        what the runtime emits per request
    segmenter.py     engine steps grouped into segments
    tensor_io.py     output tensors by shm / CUDA IPC / bytes
    observe.py       the stage's spans and metrics
"""
