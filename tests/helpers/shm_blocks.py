"""The /dev/shm files of a mesh, for the shm tests."""

from __future__ import annotations

import os

from services.mesh.tensors.shm import SHM_ROOT


def blocks_of(mesh: str) -> list[str]:
    return sorted(n for n in os.listdir(SHM_ROOT) if n.startswith(f"omni-{mesh}-"))
