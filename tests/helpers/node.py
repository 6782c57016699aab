"""The Node.js examples (examples/clients/node) with their npm dependencies."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

CLIENT = Path(__file__).resolve().parents[2] / "examples" / "clients" / "node"


def node_client(package: str) -> Path:
    """The examples' folder once ``package`` is installed there (``npm ci`` once per
    checkout). Without node and npm the test is skipped, saying why; under CI it fails."""
    missing = [tool for tool in ("node", "npm") if shutil.which(tool) is None]
    if missing:
        reason = f"{' and '.join(missing)} not installed: the Node.js client is not tried"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    if not (CLIENT / "node_modules" / package).is_dir():
        subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund", "--loglevel", "error"],
            cwd=CLIENT,
            check=True,
            timeout=300,
        )
    return CLIENT
