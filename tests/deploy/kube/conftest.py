"""A real kube-apiserver on etcd for this folder's tests, started once per session
(tests/deploy/kube/apiserver.py), and a fresh namespace per test holding the chart's
ServiceAccount, Role and RoleBinding."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.kube import apiserver
from tests.deploy.kube.cluster import Namespace
from tests.deploy.kube.proxy import Relay

_names = itertools.count()


@pytest.fixture(scope="session")
def kube_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[apiserver.KubeServer]:
    binary = apiserver.built_binary()
    server = apiserver.start(binary, tmp_path_factory.mktemp("kube"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def relay(kube_server: apiserver.KubeServer) -> Iterator[Relay]:
    """The orchestrator's way to the API server (the tests cut it)."""
    relay = Relay(kube_server.port)
    yield relay
    relay.close()


def in_cluster(
    monkeypatch: pytest.MonkeyPatch, namespace: Namespace, relay: Relay, folder: Path
) -> None:
    """The orchestrator of this process sees what a Pod of the chart's account sees."""
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(relay.port))
    monkeypatch.setenv("OMNI_KUBE_SERVICEACCOUNT_DIR", str(namespace.mount_token(folder)))


@pytest.fixture
def namespace(
    kube_server: apiserver.KubeServer,
    relay: Relay,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> Iterator[Namespace]:
    """A namespace with the chart's Role bound to its account, whose token this
    process's orchestrator uses."""
    space = Namespace(kube_server, f"omni-{next(_names)}")
    in_cluster(monkeypatch, space, relay, tmp_path / "serviceaccount")
    yield space
    space.close()
