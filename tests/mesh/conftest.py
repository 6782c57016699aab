"""Fixtures of the shm tests: a throwaway mesh id and its producer."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from services.mesh.tensors.shm import SHM_ROOT, ShmProducer
from tests.helpers.shm_blocks import blocks_of


@pytest.fixture
def mesh() -> Iterator[str]:
    """A mesh id no other test (or engineer) uses; its leftovers are removed after."""
    mesh_id = f"t{uuid.uuid4().hex[:12]}"
    try:
        yield mesh_id
    finally:
        for name in blocks_of(mesh_id):
            (SHM_ROOT / name).unlink(missing_ok=True)


@pytest.fixture
def producer(mesh: str) -> Iterator[ShmProducer]:
    with ShmProducer(mesh) as shm:
        yield shm
