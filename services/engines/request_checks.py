"""Checks every engine makes of a request in the same way: which one input it
gives (one presence rule), tensors it does not know, and the seed.

Presence: text counts when it is not empty, messages and token ids when there
is at least one, a tensor when it is there. Refusals name the field
(INVALID_ARGUMENT): the unknown tensor; ``inputs`` when more than one input or
none is given (or the one input an engine takes, when it takes one kind only);
the input given when this engine does not take it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NoReturn

from services.engines.base import EngineRequest
from services.mesh.errors import InvalidArgument

TEXT = "inputs.text"
MESSAGES = "inputs.messages"
TOKEN_IDS = "inputs.token_ids"
SEED_LIMIT = 2**63  # seeds travel as uint64; torch and vLLM take below 2**63


def tensor_field(name: str) -> str:
    return f"inputs.tensors.{name}"


def refuse(field: str, why: str) -> NoReturn:
    raise InvalidArgument(f"{field}: {why}", field=field)


def refuse_unknown_tensors(request: EngineRequest, known: Collection[str]) -> None:
    for name in request.tensors:
        if name not in known:
            takes = ", ".join(repr(k) for k in known) or "none"
            refuse(
                tensor_field(name), f"unknown input tensor {name!r} (this engine takes: {takes})"
            )


def given_inputs(request: EngineRequest) -> list[str]:
    """The fields of the inputs ``request`` gives, by the one presence rule."""
    given = [
        field
        for field, present in (
            (TEXT, bool(request.text)),
            (MESSAGES, bool(request.messages)),
            (TOKEN_IDS, bool(request.token_ids)),
        )
        if present
    ]
    return given + [tensor_field(name) for name in request.tensors]


def one_input(request: EngineRequest, accepted: Sequence[str]) -> str:
    """The field of the one input ``request`` gives among ``accepted``; tensors
    that are not accepted must have been refused first (refuse_unknown_tensors)."""
    given = given_inputs(request)
    choice = accepted[0] if len(accepted) == 1 else f"one of {', '.join(accepted)}"
    if len(given) > 1:
        refuse("inputs", f"give exactly {choice} (found: {', '.join(given)})")
    if not given:
        refuse(accepted[0] if len(accepted) == 1 else "inputs", f"expected {choice}")
    if given[0] not in accepted:
        refuse(given[0], f"this engine takes {choice} instead")
    return given[0]


def check_seed(seed: int | None) -> None:
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        refuse("params.seed", f"must be in [0, 2**63), got {seed}")
