"""The soak (benchmarks/soak.py) for two minutes: ordinary requests go on through
floods of idle connections, big unary messages, slow readers and a killed stage,
against `omni up` with auth on, and the orchestrator's descriptors do not grow."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.soak import soak


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_two_minutes_under_siege(tmp_path: Path, omni_cache_dir: Path) -> None:
    summary = await soak(2, omni_cache_dir, tmp_path / "soak.json")
    assert summary["requests"] > 20
    assert summary["ok_rate"] >= 0.999, summary["rows"]
    baseline, *minutes = [row["orch fds"] for row in summary["rows"]]
    # No growth: after each minute's hostile traffic has gone, the orchestrator
    # holds about what it held before any (its stage channels, a client or two).
    assert max(minutes) <= baseline + 16, summary["rows"]
    assert minutes[-1] <= minutes[0] + 8, summary["rows"]
