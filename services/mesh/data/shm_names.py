"""The names of shared blocks, and what each part of one says.

    omni-<mesh>-<producer>-<request>-<secret>

``mesh`` keeps the meshes of one machine apart (a ref of another mesh is refused
before the file system is touched); ``producer`` names the lock its producer
holds while it lives (``shm_dir``: the sweep's liveness test); ``request`` binds
the block to the request it was made for, a digest of its id, so a ref copied
into another request is refused; ``secret`` (128 random bits) makes the name a
capability that cannot be guessed from the rest. A pooled block between two
requests has ``free`` for its request and is no request's to open.
"""

from __future__ import annotations

import hashlib
import re
import secrets

MESH = r"[a-z0-9][a-z0-9-]{0,30}"  # as OMNI_MESH_ID (services/mesh/environment.py)
PRODUCER_HEX = 16
REQUEST_HEX = 16
SECRET_HEX = 32
FREE = "free"
BLOCK_NAME = re.compile(
    rf"omni-(?P<mesh>{MESH})-(?P<producer>[0-9a-f]{{{PRODUCER_HEX}}})"
    rf"-(?P<request>[0-9a-f]{{{REQUEST_HEX}}}|{FREE})-(?P<secret>[0-9a-f]{{{SECRET_HEX}}})"
)


def request_tag(request_id: str) -> str:
    """The part of a block's name that binds it to request ``request_id``."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=REQUEST_HEX // 2, person=b"omni-shm")
    return digest.hexdigest()


def block_name(mesh_id: str, producer: str, request_id: str | None) -> str:
    """A fresh name for a block of ``producer`` made for ``request_id`` (None: a
    free pooled block)."""
    request = FREE if request_id is None else request_tag(request_id)
    return f"omni-{mesh_id}-{producer}-{request}-{secrets.token_hex(SECRET_HEX // 2)}"
