"""A running stage's request path, in the order a request meets it:

generate_rpc.py  one Generate stream's input side: Submits, chunks, Cancels, Credits
frames.py        one Generate frame read (chunks by hand)
convert.py       a Submit read: its fields, size and parameters
inputs.py        decode, and join pieces/windows into whole tensors
content.py       chat content parts: kinds the engine takes, ChatTurns and MediaParts
transforms.py    input processors on whole inputs (named in Describe)
requests.py      the one registry of requests in flight
runtime.py       plan (the engine's check), start, engine drive, the final event
admission.py     how many requests the stage holds: a counter
segmenter.py     engine steps grouped into segments
events.py        what the runtime emits per request
outputs.py       the stream's output side: events into StageOutputs, in order
tensor_io.py     output tensors by shm / CUDA IPC / bytes
observe.py       the stage's spans and metrics
"""
