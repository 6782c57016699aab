"""The wheel carries what an installed `omni` needs beyond code: the example
pipelines and stage files that `omni up` and the images start from."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from orchestrator.server.pipeline import load_pipeline

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "orchestrator" / "examples"

# Print where the installed default pipeline is and the stage files it launches.
_RESOLVE = """
import json, orchestrator
from orchestrator.cli.commands import default_pipeline
from orchestrator.server.pipeline import load_pipeline
path = default_pipeline()
stages = load_pipeline(path).stages
print(json.dumps({"package": orchestrator.__file__, "pipeline": str(path.resolve()),
                  "launch": [str(s.launch) for s in stages]}))
"""


def _build_wheel(tmp_path: Path) -> Path:
    # A copy of the sources, so the build's own folders never land in the checkout.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for name in ("services", "orchestrator"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", dist, src],
        check=True,
        timeout=300,
    )
    (wheel,) = dist.glob("omni_mesh-*.whl")
    return wheel


def test_installed_wheel_ships_the_examples_and_omni_up_starts_from_them(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path)
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if "/examples/" in n}
    in_checkout = {
        f"orchestrator/examples/{p.relative_to(EXAMPLES).as_posix()}"
        for p in EXAMPLES.rglob("*")
        if p.is_file()
    }
    assert shipped == in_checkout

    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", site, wheel],
        check=True,
        timeout=300,
    )
    # Run from a folder with no examples/ and no checkout on the path: only the wheel.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run(
        [sys.executable, "-c", _RESOLVE],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert Path(found["package"]).is_relative_to(site)
    assert found["pipeline"] == str(site / "orchestrator/examples/pipelines/default.yaml")
    # Every stage file the checkout's default pipeline launches, from the wheel.
    checkout = load_pipeline(REPO / "orchestrator/examples/pipelines/default.yaml")
    assert found["launch"] == [
        str(site / "orchestrator/examples/pipelines/stages" / stage.launch.name)
        for stage in checkout.stages
        if stage.launch is not None
    ]
    assert len(found["launch"]) == len(checkout.stages)


def test_the_checkout_examples_links_are_the_packaged_folders() -> None:
    # The docs and tests say examples/pipelines/...; the files live in the package.
    # (examples/clients/ is not package data: client programs for other languages.)
    for name in ("pipelines", "stages"):
        assert (REPO / "examples" / name).resolve() == (EXAMPLES / name).resolve()
    assert sorted(p.name for p in EXAMPLES.iterdir()) == ["pipelines", "stages"]
