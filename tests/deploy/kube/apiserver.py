"""A real kube-apiserver (1.20.2, built by .ci/kube-apiserver.sh) on a real etcd, on
127.0.0.1 free ports, for tests: static tokens (an admin; service accounts get
theirs through the TokenRequest API), RBAC authorisation, TLS by a throwaway CA.

It runs without the watch cache, so a watch from a version that etcd has compacted
away answers 410 Gone (``compact``), as one from a version the cache has moved past
does in a cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from services.mesh.security.certs import MeshCA
from tests.helpers.ports import free_port

VERSION = "1.20.2"
BUILD_WAIT_S = 20 * 60  # CI builds it in the background while it installs the rest


def cache_dir() -> Path:
    root = os.environ.get("OMNI_KUBE_CACHE") or Path.home() / ".cache/omni-mesh/kube-apiserver"
    return Path(root) / VERSION


def built_binary() -> Path:
    """The kube-apiserver binary, waiting for a build in progress; fails (CI) or skips
    (elsewhere) naming the command when there is none, fails with the log's tail when
    the build failed."""
    folder = cache_dir()
    command = "bash .ci/kube-apiserver.sh (root: apt-get; about 3-5 min on 2 cores)"
    give_up = time.monotonic() + BUILD_WAIT_S
    while not (folder / "ok").exists():
        if (folder / "failed").exists():
            log = (folder / "build.log").read_text(errors="replace")[-3000:]
            pytest.fail(f"building kube-apiserver failed ({folder}/build.log):\n{log}")
        if not _building(folder):
            missing = f"no kube-apiserver built in {folder}: run {command}"
            if os.environ.get("CI") == "true":
                pytest.fail(missing)
            pytest.skip(missing)
        if time.monotonic() > give_up:
            pytest.fail(f"kube-apiserver still building after {BUILD_WAIT_S} s ({folder})")
        time.sleep(2)
    if shutil.which("etcd") is None:
        pytest.fail(f"etcd is missing (Debian's etcd-server): run {command}")
    return folder / "kube-apiserver"


def _building(folder: Path) -> bool:
    try:
        os.kill(int((folder / "building").read_text()), 0)
    except (OSError, ValueError):
        return False
    return True


@dataclass
class KubeServer:
    """etcd and kube-apiserver, running; ``url`` is the API's, ``ca`` its CA file."""

    url: str
    port: int
    ca: Path
    admin_token: str
    etcd_url: str
    processes: list[subprocess.Popen[bytes]]

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.terminate()
        for process in reversed(self.processes):
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def compact(self) -> int:
        """Compacts etcd at its current revision: older versions are gone (410)."""
        revision = int(self._etcd("/v3/kv/range", {"key": "AA=="})["header"]["revision"])
        self._etcd("/v3/kv/compaction", {"revision": str(revision), "physical": True})
        return revision

    def _etcd(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            self.etcd_url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            answer: dict[str, Any] = json.loads(response.read())
            return answer


def start(binary: Path, folder: Path) -> KubeServer:
    folder.mkdir(parents=True, exist_ok=True)
    processes: list[subprocess.Popen[bytes]] = []
    logs = folder / "logs"
    logs.mkdir(exist_ok=True)
    try:
        client_port, peer_port = free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{client_port}"
        peer = f"http://127.0.0.1:{peer_port}"
        processes.append(
            subprocess.Popen(
                [
                    "etcd",
                    f"--data-dir={folder / 'etcd'}",
                    f"--listen-client-urls={etcd_url}",
                    f"--advertise-client-urls={etcd_url}",
                    f"--listen-peer-urls={peer}",
                    f"--initial-advertise-peer-urls={peer}",
                    f"--initial-cluster=default={peer}",
                ],
                stdout=(logs / "etcd.log").open("wb"),
                stderr=subprocess.STDOUT,
            )
        )
        ca = MeshCA(folder / "pki", name="kube-test-ca")
        serving = ca.issue("kube-apiserver")
        signing = ec.generate_private_key(ec.SECP256R1())
        (folder / "sa.key").write_bytes(
            signing.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        (folder / "sa.pub").write_bytes(
            signing.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        admin_token = os.urandom(16).hex()
        (folder / "tokens.csv").write_text(f'{admin_token},admin,admin,"system:masters"\n')
        port = free_port()
        processes.append(
            subprocess.Popen(
                [
                    str(binary),
                    f"--etcd-servers={etcd_url}",
                    "--bind-address=127.0.0.1",
                    f"--secure-port={port}",
                    "--insecure-port=0",
                    f"--tls-cert-file={serving.cert}",
                    f"--tls-private-key-file={serving.key}",
                    f"--token-auth-file={folder / 'tokens.csv'}",
                    "--authorization-mode=RBAC",
                    "--service-account-issuer=https://kubernetes.default.svc",
                    f"--service-account-key-file={folder / 'sa.pub'}",
                    f"--service-account-signing-key-file={folder / 'sa.key'}",
                    "--service-cluster-ip-range=10.96.0.0/24",
                    # No controllers run: no token controller to give "default" a secret.
                    "--disable-admission-plugins=ServiceAccount",
                    "--watch-cache=false",
                ],
                stdout=(logs / "kube-apiserver.log").open("wb"),
                stderr=subprocess.STDOUT,
            )
        )
        server = KubeServer(
            f"https://127.0.0.1:{port}", port, ca.ca, admin_token, etcd_url, processes
        )
        _wait_ready(server, processes, logs)
        return server
    except BaseException:
        for process in processes:
            process.kill()
            process.wait()
        raise


def _wait_ready(server: KubeServer, processes: list[subprocess.Popen[bytes]], logs: Path) -> None:
    import ssl

    context = ssl.create_default_context(cafile=str(server.ca))
    request = urllib.request.Request(
        server.url + "/readyz", headers={"Authorization": f"Bearer {server.admin_token}"}
    )
    give_up = time.monotonic() + 90
    while True:
        for process in processes:
            if process.poll() is not None:
                tail = "".join(
                    f"--- {log.name}\n{log.read_text(errors='replace')[-2000:]}"
                    for log in logs.iterdir()
                )
                raise RuntimeError(f"{process.args[0]} exited {process.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(request, context=context, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > give_up:
            raise RuntimeError(f"kube-apiserver not ready in 90 s (logs in {logs})")
        time.sleep(0.3)
