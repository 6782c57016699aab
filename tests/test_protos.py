"""The committed stubs are exactly what protos/ generates."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(root / "protos" / "generate.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_committed_stubs_match_the_protos() -> None:
    done = check(REPO)
    assert done.returncode == 0, done.stderr


def test_the_check_fails_when_a_proto_changes(tmp_path: Path) -> None:
    shutil.copytree(REPO / "protos", tmp_path / "protos")
    shutil.copytree(REPO / "services" / "mesh" / "pb", tmp_path / "services" / "mesh" / "pb")
    proto = tmp_path / "protos" / "omni" / "v1" / "stage.proto"
    proto.write_text(proto.read_text() + "\nmessage Drift { string field = 1; }\n")
    done = check(tmp_path)
    assert done.returncode == 1
    assert "services/mesh/pb/omni/v1/stage_pb2.py" in done.stderr
