"""podman for the container tests: whether it can run here, the CPU image built
once per set of inputs, and workloads played from Kubernetes YAML and always
taken down.

The image is tagged ``localhost/omni:cpu-<digest>``, the digest of everything the
build reads (Containerfile, sources, pyproject, constraints, the base image), so
an unchanged tree reuses the image and two checkouts on one machine never build
over each other's tag.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import hashlib
import logging
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
CONTAINERFILE = REPO / "containers" / "Containerfile.cpu"
VLLM_CONTAINERFILE = REPO / "containers" / "Containerfile.vllm-cpu"
BASE_IMAGE = os.environ.get("OMNI_BASE_IMAGE", "localhost/omni-base:bookworm")
REPOSITORY = "localhost/omni"
# What containers/Containerfile.cpu copies (.containerignore lets nothing else in:
# no checkout's build of the kernels either; neither README.md nor docs/, so a
# documentation edit never rebuilds the image).
_INPUT_FILES = ("constraints.txt", "pyproject.toml", "setup.py", ".containerignore")
_IGNORED_SUFFIXES = (".pyc", ".so")
_INPUT_TREES = ("services", "orchestrator")
# One build, and one played mesh, at a time on this machine, whatever the checkout.
_LOCK = Path("/var/tmp/omni-container-tests.lock")
KEEP_IMAGES = 3  # test images kept on a machine (other checkouts may be using theirs)


def unavailable() -> str | None:
    """Why the container tests cannot run here, or None."""
    if shutil.which("podman") is None:
        return "podman is not installed (containers/setup-host.sh sets a machine up)"
    if run("image", "exists", BASE_IMAGE, check=False).returncode != 0:
        return f"the base image {BASE_IMAGE} is missing (containers/setup-host.sh builds it)"
    return None


def require() -> None:
    """Skip without podman, with the reason; under CI=true that is a failure."""
    reason = unavailable()
    if reason is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true and the container tests cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


def run(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(
        ["podman", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)}: exit {done.returncode}: {done.stderr}")
    return done


@contextlib.contextmanager
def machine_lock() -> Iterator[None]:
    with _LOCK.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def inputs_digest() -> str:
    digest = hashlib.sha256()
    base = run("image", "inspect", "--format", "{{.Id}}", BASE_IMAGE).stdout.strip()
    digest.update(f"base {base}\0".encode())
    files = [REPO / name for name in _INPUT_FILES] + [
        CONTAINERFILE,
        CONTAINERFILE.parent / "build-cpu.sh",
    ]
    for tree in _INPUT_TREES:
        files += [
            p
            for p in (REPO / tree).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in _IGNORED_SUFFIXES
        ]
    for path in sorted(files):
        digest.update(f"{path.relative_to(REPO).as_posix()}\0".encode())
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class Image:
    ref: str
    size_bytes: int
    build_s: float | None  # None: reused, unchanged inputs


def cpu_image(log_dir: Path) -> Image:
    """The CPU image of this tree: reused when its inputs are unchanged, else built."""
    return _image(f"{REPOSITORY}:cpu-{inputs_digest()}", CONTAINERFILE, [], log_dir)


def vllm_cpu_image(cpu: Image, log_dir: Path) -> Image:
    """The vLLM-on-CPU image over ``cpu`` (containers/Containerfile.vllm-cpu): a new
    CPU image or a changed Containerfile.vllm-cpu builds it again, else it is reused."""
    digest = hashlib.sha256(cpu.ref.encode() + b"\0" + VLLM_CONTAINERFILE.read_bytes())
    ref = f"{REPOSITORY}:vllm-cpu-{digest.hexdigest()[:16]}"
    return _image(ref, VLLM_CONTAINERFILE, ["--build-arg", f"CPU_IMAGE={cpu.ref}"], log_dir)


def _image(ref: str, containerfile: Path, args: list[str], log_dir: Path) -> Image:
    with machine_lock():
        build_s = None
        if run("image", "exists", ref, check=False).returncode != 0:
            log = log_dir / f"{containerfile.name}-build.log"
            logger.info("building %s (log: %s)", ref, log)
            began = time.monotonic()
            with log.open("w") as out:
                done = subprocess.run(
                    [str(REPO / "containers" / "build-cpu.sh"), ref, *args],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    timeout=1800,
                    check=False,
                    env={**os.environ, "OMNI_CONTAINERFILE": str(containerfile)},
                )
            build_s = time.monotonic() - began
            if done.returncode != 0:
                tail = "\n".join(log.read_text().splitlines()[-40:])
                raise RuntimeError(f"building {ref} failed (exit {done.returncode}):\n{tail}")
            _forget_old_images(keep=KEEP_IMAGES)
        size = int(run("image", "inspect", "--format", "{{.Size}}", ref).stdout.strip())
    return Image(ref=ref, size_bytes=size, build_s=build_s)


def podman_compatible(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rendered manifests with what podman 4.3 cannot play made equivalent:

    - containerPorts of host-network Pods: podman turns them into port mappings and
      then refuses them on the host network; there they only name the port anyway;
    - env from the fieldRefs spec.nodeName and status.podIP, which podman does not
      support: this machine's hostname, the only node, and 127.0.0.1 (every Pod is
      on its network);
    - a PersistentVolumeClaim whose volume exists already (podman will not create it
      twice): left out, and the volume, the model cache of an earlier run, is reused.
    """
    out = []
    for doc in copy.deepcopy(docs):
        if doc["kind"] == "PersistentVolumeClaim":
            if run("volume", "exists", doc["metadata"]["name"], check=False).returncode == 0:
                continue
        if doc["kind"] == "Deployment":
            pod = doc["spec"]["template"]["spec"]
            for container in pod["containers"]:
                if pod.get("hostNetwork"):
                    container.pop("ports", None)
                for env in container.get("env", []):
                    field = env.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
                    if field == "spec.nodeName":
                        del env["valueFrom"]
                        env["value"] = socket.gethostname()
                    elif field == "status.podIP":  # the host network's Pods: this host
                        del env["valueFrom"]
                        env["value"] = "127.0.0.1"
        out.append(doc)
    return out


def _forget_old_images(keep: int) -> None:
    """Untag all but the newest ``keep`` test images, so a machine that builds for
    every change does not fill its disk (their shared layers stay for the cache)."""
    listed = run("images", "--format", "{{.CreatedAt}}\t{{.Repository}}:{{.Tag}}").stdout
    for kind in ("cpu", "vllm-cpu"):
        ours = sorted(
            (line.split("\t") for line in listed.splitlines() if f"\t{REPOSITORY}:{kind}-" in line),
            reverse=True,
        )
        for _created, ref in ours[keep:]:
            run("rmi", ref, check=False)  # one in use by a container stays


@contextlib.contextmanager
def kube_played(manifests: Path) -> Iterator[list[str]]:
    """``podman kube play``, yielding the pods it made. On every way out: the
    containers' last log lines when something failed, ``podman kube down``, then
    whatever is left of it removed (a failed play leaves pods that kube down misses).
    A claim's volume stays: it is the model cache."""
    docs = [d for d in yaml.safe_load_all(manifests.read_text()) if d]
    _remove(docs)  # what a run that was killed may have left
    try:
        run("kube", "play", str(manifests), timeout=300)
        yield pods_of(docs)
    except BaseException:
        for pod in pods_of(docs):
            logger.error("pod %s logs:\n%s", pod, _pod_logs(pod))
        raise
    finally:
        run("kube", "down", str(manifests), check=False, timeout=120)
        _remove(docs)


def pods_of(docs: list[dict[str, Any]]) -> list[str]:
    """The pods podman made for these Deployments: <name>-pod-<i> (podman 4.3) or
    <name>-pod (later versions)."""
    names = [d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"]
    pattern = re.compile(rf"^({'|'.join(map(re.escape, names))})-pod(-\d+)?$")
    listed = run("pod", "ps", "--format", "{{.Name}}").stdout.split()
    return sorted(name for name in listed if pattern.match(name))


def _remove(docs: list[dict[str, Any]]) -> None:
    for pod in pods_of(docs):
        run("pod", "rm", "--force", "--time", "5", pod, check=False, timeout=120)
    # ConfigMaps become volumes of their name: stale content must not outlive a run.
    for doc in docs:
        if doc["kind"] == "ConfigMap":
            run("volume", "rm", "--force", doc["metadata"]["name"], check=False)


def _pod_logs(pod: str) -> str:
    done = run("pod", "logs", "--tail", "40", pod, check=False, timeout=60)
    return done.stdout + done.stderr


def container_of(pod: str, container: str) -> str:
    """podman's name for a container of a played pod."""
    return f"{pod}-{container}"


def main() -> int:
    """Build this tree's images ahead of the container tests, which then reuse them:
    ``python -m tests.containers.podman`` (.ci/run does, in the background)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    why = unavailable()
    if why is not None:
        print(f"no images built: {why}")
        return 0
    logs = Path(tempfile.mkdtemp(prefix="omni-images-"))
    cpu = cpu_image(logs)
    print(cpu)
    print(vllm_cpu_image(cpu, logs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
