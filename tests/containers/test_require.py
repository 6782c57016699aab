"""Without podman the container tests skip and say why; under CI=true they fail."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.containers import podman


def test_without_podman_a_developer_is_told_why_and_ci_fails(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no podman on it
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="podman is not installed"):
        podman.require()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"CI=true .* podman is not installed"):
        podman.require()
