"""What makes a Pod a replica (kube_source.ready_replicas), and a stage that names
its Pods where there is no Kubernetes API: it finds its replicas by its address's
DNS name and says so once. Against a real API server: tests/deploy/kube."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.server.pipeline import parse_pipeline
from orchestrator.server.server import OrchestratorServer
from orchestrator.server.stages.kube_source import PodReplica, ready_replicas
from tests.helpers.polling import eventually
from tests.helpers.ports import free_port
from tests.orchestrator.server.requests.test_replicas import replicas


def pod(name: str, ip: str = "10.0.0.1", ready: str = "True", **meta: str) -> dict[str, object]:
    return {
        "metadata": {"name": name, **meta},
        "spec": {"nodeName": "node-a"},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": ready}]},
    }


def test_a_replica_is_a_pod_with_an_ip_ready_and_not_being_deleted() -> None:
    pods = [
        pod("serves"),
        pod("v6", ip="fd00::1"),
        pod("not-ready", ip="10.0.0.2", ready="False"),
        pod("no-ip", ip=""),
        pod("leaving", ip="10.0.0.3", deletionTimestamp="2026-01-01T00:00:00Z"),
        {"metadata": {"name": "pending"}, "status": {"phase": "Pending"}},
    ]
    assert ready_replicas(pods, 50051) == {
        "10.0.0.1:50051": PodReplica("10.0.0.1:50051", "serves", "node-a"),
        "[fd00::1]:50051": PodReplica("[fd00::1]:50051", "v6", "node-a"),
    }


async def test_outside_a_cluster_the_stage_goes_by_dns_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, omni_cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    port = free_port()
    stage = {"name": "solo", "address": f"dns:///127.0.0.1:{port}", "pods": "app=solo"}
    config = parse_pipeline({"name": "solo", "stages": [stage], "outputs": ["solo"]}, "p.yaml")
    async with replicas(omni_cache_dir, 1, port=port) as servers:
        (address,) = servers
        server = OrchestratorServer(config)
        await server.start("127.0.0.1", 0)
        try:
            found = server.replicas["solo"]
            await eventually(lambda: address in found.replicas, 10, message="not by DNS")
        finally:
            await server.stop(1.0)
    told = [r for r in caplog.records if "by DNS" in r.getMessage()]
    assert len(told) == 1 and "no Kubernetes API" in told[0].getMessage(), told
