"""The shared blocks of a mesh as files, for tests that look at /dev/shm."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from services.mesh.data.shm_dir import mesh_dir
from services.mesh.data.shm_names import BLOCK_NAME


def block_path(mesh: str, name: str) -> Path:
    return mesh_dir(mesh) / name


def blocks_of(mesh: str) -> list[str]:
    """The names of ``mesh``'s blocks (pooled ones included), sorted."""
    try:
        names = os.listdir(mesh_dir(mesh))
    except FileNotFoundError:
        return []
    return sorted(n for n in names if BLOCK_NAME.fullmatch(n))


def inodes_of(mesh: str) -> dict[str, int]:
    """``mesh``'s blocks by name, with their inode: a renamed block keeps its inode."""
    return {name: block_path(mesh, name).stat().st_ino for name in blocks_of(mesh)}


def remove_mesh(mesh: str) -> None:
    """Whatever a test's mesh left in /dev/shm."""
    shutil.rmtree(mesh_dir(mesh), ignore_errors=True)
