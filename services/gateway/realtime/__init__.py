"""The OpenAI Realtime API at /v1/realtime: a session per WebSocket, GA event
names (docs/api.md lists every event, served and refused).

    endpoint.py        the WebSocket: limits, close codes, the reader loop
    outbox.py          server events queued in order, bounded while unread
    client_events.py   the client events, validated; refusals name the field
    session.py         one session: settings, events in order, the response in flight
    input_audio.py     the input audio buffer, server VAD's turns over it, commits
    item_edits.py      a client's item create / retrieve / truncate, checked
    session_config.py  the ``session`` object, merged and validated per update
    conversation.py    items, and the budget of what a response sends
    items.py           a client's item, part by part, checked
    plan.py            one response.create as the mesh's GenerateRequest
    response.py        one response: the mesh's events as server events, cancel
    vad.py             server VAD: where turns start and stop
    silero.py          Silero VAD's ONNX model, run by onnxruntime
    wire.py            server event shapes built in one place
"""
