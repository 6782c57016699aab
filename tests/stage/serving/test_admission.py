"""Admission counts the requests a stage holds: up to max_batch_size running plus
max_queue_size waiting (in the engine), and one more is refused at once, naming both."""

from __future__ import annotations

import grpc
import pytest

from services.mesh.errors import ResourceExhausted
from services.stage.serving.admission import Admission


def test_holds_a_batch_and_a_queue_then_refuses_naming_both_settings() -> None:
    admission = Admission("thinker", max_batch_size=2, max_queue_size=1)
    for rid in ("a", "b", "c"):
        admission.enter(rid)
    with pytest.raises(ResourceExhausted) as refused:
        admission.enter("d")
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused.value.field == "request_id"
    assert refused.value.message == (
        "request d: stage thinker is full: 3 requests, up to 2 running "
        "(runtime.max_batch_size) and 1 waiting (runtime.max_queue_size)"
    )
    assert admission.held == 3  # the refused one is not counted


def test_a_request_that_leaves_makes_room_at_once() -> None:
    admission = Admission("thinker", max_batch_size=1, max_queue_size=0)
    admission.enter("a")
    with pytest.raises(ResourceExhausted):
        admission.enter("b")
    admission.leave()
    admission.enter("b")
    assert admission.held == 1
