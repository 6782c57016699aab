"""Fixtures of the shm tests: a throwaway mesh id and its producer."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from services.mesh.tensors.shm import ShmProducer
from tests.helpers.shm_blocks import remove_mesh


@pytest.fixture
def mesh() -> Iterator[str]:
    """A mesh id no other test (or engineer) uses; its leftovers are removed after."""
    mesh_id = f"t{uuid.uuid4().hex[:12]}"
    try:
        yield mesh_id
    finally:
        remove_mesh(mesh_id)


@pytest.fixture
def producer(mesh: str) -> Iterator[ShmProducer]:
    with ShmProducer(mesh) as shm:
        yield shm
