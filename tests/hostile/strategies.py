"""Hypothesis strategies built from the contract's message descriptors: any
message of protos/omni/v1 (every field optional, at most one member of each
oneof, recursion bounded), with values biased towards the ones our code treats
specially (dtype names, tensor names, roles, limits of each integer type), and
now and then a tensor whose dtype, shape and bytes agree, so that generated
input also reaches the engine and not only the first check."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

from services.mesh.data.wire import ITEMSIZE
from services.mesh.pb.omni.v1 import tensor_pb2

WORDS = (
    "",
    "h",
    "w",
    "user",
    "assistant",
    "system",
    "prompt_embeds",
    "hidden_states",
    "hidden_states_to_prompt_embeds",
    "float32",
    "float16",
    "bfloat16",
    "int64",
    "uint8",
    "float8_e4m3fn",
    "c1",
    "traceparent",
    "../../etc/passwd",
    "omni-default-1-1-" + "0" * 32,
    "Hello, how are you?",
    "\u202e\u0000\x7f",
)

_INT_LIMITS = {
    FieldDescriptor.TYPE_INT32: (-(1 << 31), (1 << 31) - 1),
    FieldDescriptor.TYPE_SINT32: (-(1 << 31), (1 << 31) - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(1 << 31), (1 << 31) - 1),
    FieldDescriptor.TYPE_INT64: (-(1 << 63), (1 << 63) - 1),
    FieldDescriptor.TYPE_SINT64: (-(1 << 63), (1 << 63) - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(1 << 63), (1 << 63) - 1),
    FieldDescriptor.TYPE_UINT32: (0, (1 << 32) - 1),
    FieldDescriptor.TYPE_FIXED32: (0, (1 << 32) - 1),
    FieldDescriptor.TYPE_UINT64: (0, (1 << 64) - 1),
    FieldDescriptor.TYPE_FIXED64: (0, (1 << 64) - 1),
}


def _integers(low: int, high: int) -> st.SearchStrategy[int]:
    edges = [v for v in (0, 1, 2, 3, 4, 16, 64, -1, low, high, high // 2 + 1) if low <= v <= high]
    return st.one_of(st.sampled_from(edges), st.integers(low, high), st.integers(0, 8))


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    kind = field.type
    if kind in _INT_LIMITS:
        return _integers(*_INT_LIMITS[kind])
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_FLOAT:
        return st.one_of(st.sampled_from([0.0, 0.5, 1.0, -1.0, math.nan]), st.floats(width=32))
    if kind == FieldDescriptor.TYPE_DOUBLE:
        return st.floats()
    if kind == FieldDescriptor.TYPE_STRING:
        return st.one_of(st.sampled_from(WORDS), st.text(max_size=24))
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.one_of(st.binary(max_size=48), st.integers(0, 4).map(lambda n: bytes(256 * n)))
    if kind == FieldDescriptor.TYPE_ENUM:
        numbers = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(numbers), st.integers(-2, 40))
    raise TypeError(f"no strategy for field {field.full_name} of type {kind}")


def agreeing_tensor() -> st.SearchStrategy[tensor_pb2.Tensor]:
    """A tensor whose dtype, shape and bytes agree (it decodes)."""

    def build(name: str, dtype: str, shape: list[int], fill: int) -> tensor_pb2.Tensor:
        raw = bytes([fill]) * (math.prod(shape) * ITEMSIZE[dtype])
        return tensor_pb2.Tensor(name=name, dtype=dtype, shape=shape, raw=raw)

    return st.builds(
        build,
        st.sampled_from(["prompt_embeds", "hidden_states", "x"]),
        st.sampled_from(["float32", "float16", "bfloat16", "int64", "uint8", "float8_e5m2"]),
        st.lists(st.sampled_from([0, 1, 2, 3, 64]), max_size=3),
        st.sampled_from([0, 1, 0x3C, 0x7F, 0xFF]),
    )


OVERRIDES: dict[str, Callable[[], st.SearchStrategy[Message]]] = {
    "omni.v1.Tensor": agreeing_tensor,
}


def messages(descriptor: Descriptor, depth: int = 5) -> st.SearchStrategy[Message]:
    """Any message of ``descriptor``'s type, nested at most ``depth`` levels."""
    cls = GetMessageClass(descriptor)
    optional: dict[str, st.SearchStrategy[Any]] = {}
    oneofs: list[st.SearchStrategy[tuple[str, Any] | None]] = []
    for oneof in descriptor.oneofs:
        if len(oneof.fields) == 1 and oneof.name.startswith("_"):
            continue  # proto3 `optional`: a plain field with presence
        members = [(f.name, _value(f, depth)) for f in oneof.fields]
        choices = [st.tuples(st.just(name), value) for name, value in members if value is not None]
        oneofs.append(st.one_of(st.none(), *choices))
    for field in descriptor.fields:
        oneof = field.containing_oneof
        if oneof is not None and not (len(oneof.fields) == 1 and oneof.name.startswith("_")):
            continue
        value = _value(field, depth)
        if value is not None:
            optional[field.name] = value

    def build(values: dict[str, Any], chosen: list[tuple[str, Any] | None]) -> Message:
        message = cls()
        for name, value in [*values.items(), *(c for c in chosen if c is not None)]:
            _set(message, descriptor.fields_by_name[name], value)
        return message

    generic = st.builds(
        build, st.fixed_dictionaries({}, optional=optional), st.tuples(*oneofs).map(list)
    )
    override = OVERRIDES.get(descriptor.full_name)
    return st.one_of(generic, override()) if override else generic


def _value(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any] | None:
    """A strategy for the field's value (a list when repeated); None past the depth."""
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        if depth <= 0:
            return None
        entry = field.message_type
        if entry.GetOptions().map_entry:
            keys = _scalar(entry.fields_by_name["key"])
            value_field = entry.fields_by_name["value"]
            values = _value(value_field, depth - 1)
            if values is None:
                return None
            return st.dictionaries(keys, values, max_size=3)
        one = messages(entry, depth - 1)
    else:
        one = _scalar(field)
    if field.is_repeated:
        return st.lists(one, max_size=3)
    return one


def _set(message: Message, field: FieldDescriptor, value: Any) -> None:
    target = getattr(message, field.name)
    if field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
        message_values = field.message_type.fields_by_name["value"].type == field.TYPE_MESSAGE
        for key, item in value.items():
            if message_values:
                target[key].CopyFrom(item)
            else:
                target[key] = item
    elif field.is_repeated:
        target.extend(value)
    elif field.type == FieldDescriptor.TYPE_MESSAGE:
        target.CopyFrom(value)
    else:
        setattr(message, field.name, value)
