"""The catalogue of hostile inputs: each case sends one kind of bad (or foreign)
input to a real stage or orchestrator and names the status and field it must
get. While it runs, an ordinary request on the same server (and one on the same
stream) completes with every token, and afterwards both servers answer health
SERVING. A case that gets UNKNOWN, INTERNAL, a Python class name, a hang, or
hurts another request is a product bug: fix the product, keep the case."""

from __future__ import annotations

import asyncio

import pytest

from tests.hostile.cases import Case
from tests.hostile.catalogue_inputs import INPUTS
from tests.hostile.catalogue_requests import REQUESTS
from tests.hostile.catalogue_wire import WIRE
from tests.hostile.conftest import Mesh

CATALOGUE = [*WIRE, *REQUESTS, *INPUTS]


@pytest.mark.parametrize("case", CATALOGUE, ids=[c.name for c in CATALOGUE])
async def test_hostile_input(mesh: Mesh, case: Case) -> None:
    control = asyncio.create_task(mesh.control(f"control-{case.name.replace(' ', '-')[:200]}"))
    try:
        outcome = await asyncio.wait_for(case.send(mesh), 60)
    finally:
        await asyncio.wait_for(control, 60)  # the ordinary request completed in full
    assert outcome.code == case.code, outcome
    assert case.field in outcome.field, outcome
    assert "<class" not in outcome.message + outcome.field and "Traceback" not in outcome.message
    await mesh.serving()
