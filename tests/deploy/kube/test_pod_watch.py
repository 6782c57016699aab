"""The orchestrator finds a stage's replicas by watching its Pods through a real
kube-apiserver, as the chart's account (its Role, rendered from charts/, bound to a
TokenRequest token), and routes real requests to real stage servers by them.

The tests play the kubelet: they create the stage's Pods from the chart's own
template and write their status (IP, Ready) and deletion. Each replica is a
stage server on 127.0.0.N, the Pod's IP, on one port (the stage's). The API is
reached through a relay (``proxy.Relay``) the tests cut to drop the watch."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from orchestrator.client import AsyncClient
from orchestrator.server.pipeline import parse_pipeline
from orchestrator.server.stages.replica import DRAINING, READY
from services.stage.server import StageServer
from tests.deploy.kube.apiserver import BUILD_WAIT_S, KubeServer, free_port
from tests.deploy.kube.cluster import Namespace, admin_api
from tests.deploy.kube.proxy import Relay
from tests.helpers.polling import eventually
from tests.orchestrator.conftest import orchestrator
from tests.orchestrator.server.requests.test_replicas import replica_view, replicas

# The first test's setup may wait for the API server's build (CI starts it in the
# background): its own limit, not pytest-timeout's 300 s.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(BUILD_WAIT_S + 300)]


def watched(port: int, selector: str):
    """The pipeline the chart writes, for one stage: its Pods by the chart's selector,
    its address a DNS name (here: the first replica's IP) for the fallback."""
    stage = {"name": "solo", "address": f"dns:///127.0.0.1:{port}", "pods": selector}
    return parse_pipeline({"name": "solo", "stages": [stage], "outputs": ["solo"]}, "p.yaml")


def served(servers: dict[str, StageServer]) -> dict[str, int]:
    return {address: len(s.engine.released) for address, s in servers.items()}


async def view_is(client_: AsyncClient, expected: dict[str, int], message: str) -> None:
    """Waits until the replicas listed are ``expected`` (address -> state)."""

    async def now() -> bool:
        return {a: r.state for a, r in (await replica_view(client_)).items()} == expected

    await eventually(now, 10, message=message)


async def test_ready_pods_serve_and_one_not_ready_or_being_deleted_drains(
    namespace: Namespace, omni_cache_dir: Path
) -> None:
    port = free_port()
    async with replicas(omni_cache_dir, 3, port=port) as servers:
        a, b, c = servers
        for index, address in enumerate(servers):
            namespace.add_pod(f"thinker-{index}", address.split(":")[0], f"node-{index}")
        async with orchestrator(watched(port, namespace.selector)) as (server, omni):
            await view_is(omni, dict.fromkeys(servers, READY), "the ready Pods not all READY")
            view = await replica_view(omni)
            assert {x: (r.pod, r.node) for x, r in view.items()} == {
                a: ("thinker-0", "node-0"),
                b: ("thinker-1", "node-1"),
                c: ("thinker-2", "node-2"),
            }
            results = await asyncio.gather(*(omni.generate("Hi").collect() for _ in range(9)))
            assert all(r.ok for r in results) and all(served(servers).values()), served(servers)

            # b holds a long request, then turns not Ready: nothing new goes there,
            # and what it holds goes on until it ends (here: aborted, not failed).
            held = omni.generate("hold", request_id="held")
            await eventually(lambda: server.router.in_flight == 1, 5)
            (holder,) = [x for x, r in (await replica_view(omni)).items() if r.in_flight]
            pod = f"thinker-{list(servers).index(holder)}"
            namespace.set_status(pod, holder.split(":")[0], ready=False)
            others = [x for x in servers if x != holder]
            await view_is(omni, {holder: DRAINING} | dict.fromkeys(others, READY), "no drain")
            before = served(servers)
            results = await asyncio.gather(*(omni.generate("Hi").collect() for _ in range(6)))
            assert all(r.ok for r in results)
            assert served(servers)[holder] == before[holder], "a not-ready Pod got a request"
            assert server.router.stage_id("held") is not None  # still running there
            await omni.abort("held")
            assert (await held.collect()).done.code_name == "CANCELLED"
            await view_is(omni, dict.fromkeys(others, READY), "the drained replica stayed")

            # Deletion starts (the Pod still Ready, still with its IP): it leaves now.
            leaving, staying = others
            namespace.start_deletion(f"thinker-{list(servers).index(leaving)}")
            await view_is(omni, {staying: READY}, "a Pod being deleted still listed")
            before = served(servers)
            assert all(r.ok for r in [await omni.generate("Hi").collect() for _ in range(3)])
            assert served(servers)[staying] == before[staying] + 3

            # Ready again, it comes back; its IP cleared (an eviction), it leaves.
            namespace.set_status(pod, holder.split(":")[0], ready=True)
            await view_is(omni, {staying: READY, holder: READY}, "a Pod Ready again not back")
            namespace.set_status(pod, "", ready=True)
            await view_is(omni, {staying: READY}, "a Pod without an IP still listed")


async def test_a_dropped_watch_reconnects_and_a_version_gone_lists_again(
    namespace: Namespace,
    relay: Relay,
    kube_server: KubeServer,
    omni_cache_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()
    caplog.set_level(logging.INFO, logger="orchestrator.server.stages.kube_source")
    async with replicas(omni_cache_dir, 3, port=port) as servers:
        a, b, c = servers
        namespace.add_pod("thinker-a", a.split(":")[0], "node-a")
        async with orchestrator(watched(port, namespace.selector)) as (_server, omni):
            await view_is(omni, {a: READY}, "the first Pod not READY")
            # The connection drops: the watch is opened again and sees what follows.
            connections = relay.accepted
            relay.cut()
            namespace.add_pod("thinker-b", b.split(":")[0], "node-b")
            await view_is(omni, {a: READY, b: READY}, "a Pod added after a drop not seen")
            assert relay.accepted > connections

            # Out of reach while a is deleted and c comes, and etcd forgets the
            # version it watched from: 410 Gone, listed again, a gone and c there.
            with relay.closed():
                namespace.delete_now("thinker-a")
                namespace.add_pod("thinker-c", c.split(":")[0], "node-c")
                await asyncio.sleep(0.2)  # a connection attempt refused meanwhile
                kube_server.compact()
            await view_is(omni, {b: READY, c: READY}, "not listed again after 410 Gone")
            assert any("(410): listing again" in r.getMessage() for r in caplog.records)
            result = await omni.generate("Hi").collect()
            assert result.ok, result.done


async def test_without_the_role_the_stage_goes_by_dns_and_says_so_once(
    kube_server: KubeServer,
    relay: Relay,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    omni_cache_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The chart's account without its RoleBinding: the API answers 403, the stage
    finds its replicas by its address's DNS name instead, and says so once."""
    from tests.deploy.kube.conftest import in_cluster

    space = Namespace(kube_server, "omni-no-role", with_role=False)
    try:
        in_cluster(monkeypatch, space, relay, tmp_path / "serviceaccount")
        port = free_port()
        async with replicas(omni_cache_dir, 2, port=port) as servers:
            a, b = servers
            space.add_pod("thinker-a", a.split(":")[0], "node-a")
            space.add_pod("thinker-b", b.split(":")[0], "node-b")
            async with orchestrator(watched(port, space.selector)) as (_server, omni):
                await view_is(omni, {a: READY}, "not by DNS")  # dns:///127.0.0.1 names a
                assert (await omni.generate("Hi").collect()).ok
                await asyncio.sleep(1)  # nothing more is said meanwhile
        told = [r for r in caplog.records if "by DNS" in r.getMessage()]
        assert len(told) == 1, [r.getMessage() for r in told]
        assert "403" in told[0].getMessage() and told[0].levelno == logging.WARNING
    finally:
        space.close()


def test_the_charts_role_allows_only_listing_and_watching_pods_here(
    namespace: Namespace, tmp_path: Path, kube_server: KubeServer
) -> None:
    """The account's token, against real RBAC: what the Pod watch calls is allowed;
    reading one Pod, another namespace, or anything else is not."""
    token = (namespace.mount_token(tmp_path / "sa") / "token").read_text()
    core = client.CoreV1Api(admin_api(kube_server, token))
    core.list_namespaced_pod(namespace.name)
    watch = core.list_namespaced_pod(
        namespace.name, watch=True, timeout_seconds=1, _preload_content=False
    )
    assert watch.status == 200
    watch.release_conn()
    namespace.add_pod("thinker-0", "127.0.0.1", "node-0")
    refused = [
        lambda: core.read_namespaced_pod("thinker-0", namespace.name),
        lambda: core.list_namespaced_pod("default"),
        lambda: core.list_pod_for_all_namespaces(),
        lambda: core.list_namespaced_endpoints(namespace.name),
        lambda: core.delete_namespaced_pod("thinker-0", namespace.name),
    ]
    for call in refused:
        with pytest.raises(ApiException) as refusal:
            call()
        assert refusal.value.status == 403
