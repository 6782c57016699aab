"""TLS, mTLS, tokens and request ownership, with real stage processes, a real
orchestrator and the real grpcurl binary."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.cli.processes import StageProcess
from orchestrator.server.server import OrchestratorServer
from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2
from services.mesh.rpc.stage_client import StageClient, chat_submit
from services.mesh.security import Dialing, mesh_dialing
from services.mesh.security.certs import MeshCA
from services.stage.config import load_stage_config
from services.stage.server import StageServer
from services.testing.configs import tiny_config, write_config
from tests.helpers.grpcurl import GRPCURL
from tests.orchestrator.server.secure_mesh import Mesh, pipeline, serve


@pytest.fixture(scope="module")
async def mesh(
    tmp_path_factory: pytest.TempPathFactory, omni_cache_dir: Path
) -> AsyncIterator[Mesh]:
    mesh = Mesh(tmp_path_factory.mktemp("secure"))
    runtime = {"torch_threads": 1, "max_batch_size": 1, "max_queue_size": 8}
    thinker_cert = mesh.ca.issue("thinker")
    talker_cert = mesh.ca.issue("talker")
    # The thinker: TLS and the mesh token (probes need no certificate).
    thinker = tiny_config("thinker", omni_cache_dir, runtime=runtime)
    thinker["security"] = {
        "tls_cert": str(thinker_cert.cert),
        "tls_key": str(thinker_cert.key),
        "mesh_token_file": str(mesh.mesh_token),
    }
    # The talker: mTLS, every caller presents a certificate of the mesh CA.
    talker = tiny_config("talker", omni_cache_dir, runtime=runtime)
    talker["security"] = {
        "tls_cert": str(talker_cert.cert),
        "tls_key": str(talker_cert.key),
        "tls_ca": str(mesh.ca.ca),
    }
    try:
        for name, config in (("thinker", thinker), ("talker", talker)):
            process = StageProcess(write_config(mesh.folder / f"{name}.yaml", config))
            mesh.stages.processes[name] = process
            mesh.stages.addresses[name] = await process.start()
        dialing = mesh_dialing(mesh.settings())
        for address in mesh.stages.addresses.values():
            async with StageClient(address, dialing) as client:
                await client.wait_ready(timeout_s=180)
        yield mesh
    finally:
        await mesh.stages.stop()


async def test_stage_with_mesh_token_refuses_strangers_but_not_probes(mesh: Mesh) -> None:
    address = mesh.stages.addresses["thinker"]
    stranger = Dialing(grpc.ssl_channel_credentials(mesh.ca.ca.read_bytes()))
    async with StageClient(address, stranger) as client:
        # Probes: health and InitStatus need no token.
        reply = await health_pb2_grpc.HealthStub(client.channel).Check(
            health_pb2.HealthCheckRequest(service="omni.v1.Stage")
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        first = await anext(aiter(client.init_events()))
        assert first.phase == stage_pb2.STARTING
        for call in (
            client.describe(),
            client.load(),
            client.abort("x"),
            client.release_tensors(stage_pb2.ReleaseTensorsRequest(request_id="x")),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Generate is refused on its metadata, before any message. The verdict is read
        # first: a write racing the refusal can surface as INTERNAL "Internal error
        # from Core" in grpcio's aio client (grpc/grpc#36066), hiding the status.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.open_stream(timeout_s=30).read()
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    wrong = Dialing(stranger.credentials, token="not-the-mesh-token-at-all")
    async with StageClient(address, wrong) as client:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.describe()
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    async with StageClient(address, mesh_dialing(mesh.settings())) as client:
        assert (await client.load()).held == 0  # the mesh may ask what it holds
        outputs = [o async for o in client.generate(chat_submit("s2", "hi", max_tokens=3))]
        assert outputs[-1].WhichOneof("kind") == "completed"
        assert sum(len(o.segment.token_ids) for o in outputs) == 3


async def test_stage_with_mtls_needs_a_mesh_certificate(mesh: Mesh) -> None:
    address = mesh.stages.addresses["talker"]
    other_ca = MeshCA(mesh.folder / "other-pki").issue("intruder")
    for dialing in (
        Dialing(grpc.ssl_channel_credentials(mesh.ca.ca.read_bytes())),  # no certificate
        Dialing(
            grpc.ssl_channel_credentials(
                mesh.ca.ca.read_bytes(), other_ca.key.read_bytes(), other_ca.cert.read_bytes()
            )
        ),  # a certificate of another CA
    ):
        async with StageClient(address, dialing) as client:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.describe()
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    async with StageClient(address, mesh_dialing(mesh.settings())) as client:
        assert (await client.describe()).name == "talker"


async def test_tokens_ownership_and_admin_pause(mesh: Mesh) -> None:
    server, address = await serve(mesh, "talker", max_pause_s=0.5)
    try:
        async with mesh.client(address, None) as anonymous:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await anonymous.list_stages()
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert await anonymous.serving()  # health stays open for probes
        async with (
            mesh.client(address, "alice") as alice,
            mesh.client(address, "bob") as bob,
            mesh.client(address, "root") as root,
        ):
            # A long request of alice's: bob cannot abort it (not found to him)...
            events = alice.generate(
                "Tell a long story", request_id="alice-1", params={"max_tokens": 2000}
            )
            stream = aiter(events)
            first = await anext(stream)
            assert first.WhichOneof("kind") == "segment"
            # Nor cancel it on a GenerateStream of his.
            call = bob.stub.GenerateStream(metadata=bob.metadata)
            cancel = orchestrator_pb2.StreamInput(cancel=stage_pb2.Cancel(request_id="alice-1"))
            await call.write(cancel)
            await call.done_writing()
            answers = [event async for event in call]
            assert [(e.done.request_id, e.done.code_name) for e in answers] == [
                ("alice-1", "NOT_FOUND")
            ]
            reply = await bob.abort("alice-1")
            assert list(reply.not_found) == ["alice-1"] and not reply.aborted
            assert "alice-1" in server.router
            # ...alice can.
            reply = await alice.abort("alice-1")
            assert list(reply.aborted) == ["alice-1"]
            rest = [e async for e in stream]
            assert rest[-1].done.code_name == "CANCELLED"
            # Pausing is an admin's act.
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await alice.pause()
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            await root.pause()
            # Past max_pause_s a new request is refused, not held forever.
            result = await alice.generate("Hi", params={"max_tokens": 2}).collect()
            assert result.done is not None and result.done.code_name == "UNAVAILABLE"
            assert "paused" in result.done.message
            await root.resume()
            result = await alice.generate("Hi", params={"max_tokens": 2}).collect()
            assert result.ok, result.done
            assert len(result.stages["talker"].token_ids) > 0
    finally:
        await server.stop(1.0)


async def test_peers_pass_on_the_callers_token_over_tls(mesh: Mesh) -> None:
    """Two orchestrators told of each other (issue 39): an Abort or a Pause sent to B
    reaches A over TLS, as the caller: bob cannot abort alice's request through B."""
    ports = [_free_port(), _free_port()]
    peers = "ipv4:" + ",".join(f"127.0.0.1:{p}" for p in ports)
    servers = [
        OrchestratorServer(pipeline(mesh, "talker"), security=mesh.settings(), peers=peers)
        for _ in ports
    ]
    try:
        for server, port in zip(servers, ports, strict=True):
            await server.start("127.0.0.1", port)
        a, b = (f"localhost:{port}" for port in ports)
        async with (
            mesh.client(a, "alice") as alice_a,
            mesh.client(b, "alice") as alice_b,
            mesh.client(b, "bob") as bob_b,
            mesh.client(b, "root") as root_b,
        ):
            await alice_a.wait_ready(timeout_s=60)
            stream = aiter(
                alice_a.generate("A long story", request_id="alice-9", params={"max_tokens": 2000})
            )
            assert (await anext(stream)).WhichOneof("kind") == "segment"
            reply = await bob_b.abort("alice-9")
            assert list(reply.not_found) == ["alice-9"] and not reply.aborted
            assert "alice-9" in servers[0].router
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await alice_b.pause()
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert not servers[0].router.generation.paused
            reply = await alice_b.abort("alice-9")
            assert list(reply.aborted) == ["alice-9"]
            rest = [e async for e in stream]
            assert rest[-1].done.code_name == "CANCELLED"
            await root_b.pause()
            assert all(server.router.generation.paused for server in servers)
            await root_b.resume()
            assert not any(server.router.generation.paused for server in servers)
    finally:
        for server in servers:
            await server.stop(1.0)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_grpcurl_with_cacert_and_bearer_token(mesh: Mesh) -> None:
    server, address = await serve(mesh, "thinker")
    try:

        async def grpcurl(*args: str) -> tuple[int, str, str]:
            proc = await asyncio.create_subprocess_exec(
                GRPCURL,
                "-cacert",
                str(mesh.ca.ca),
                "-max-time",
                "60",
                *args,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            out, err = await proc.communicate()
            return proc.returncode or 0, out.decode(), err.decode()

        code, out, _ = await grpcurl(address, "list")
        assert code == 0 and "omni.v1.Orchestrator" in out
        code, out, err = await grpcurl(address, "omni.v1.Orchestrator/ListStages")
        assert code != 0 and "Unauthenticated" in err
        header = f"authorization: Bearer {mesh.tokens['alice']}"
        code, out, err = await grpcurl("-H", header, address, "omni.v1.Orchestrator/ListStages")
        assert code == 0, err
        stages = json.loads(out)["stages"]
        assert [s["name"] for s in stages] == ["thinker"]
        assert all(
            s["state"] == orchestrator_pb2.StageState.Name(orchestrator_pb2.STAGE_READY)
            for s in stages
        )
    finally:
        await server.stop(1.0)


async def test_probe_ports_serve_plaintext_health_and_nothing_else(
    mesh: Mesh, omni_cache_dir: Path
) -> None:
    """Under mTLS a stage's main port refuses a plaintext caller, as Kubernetes' gRPC
    probes are; its --health-port answers them, with health and no other method."""
    cert = mesh.ca.issue("probed")
    config = tiny_config("probed", omni_cache_dir, runtime={"torch_threads": 1})
    config["security"] = {
        "tls_cert": str(cert.cert),
        "tls_key": str(cert.key),
        "tls_ca": str(mesh.ca.ca),
    }
    stage = StageServer(load_stage_config(write_config(mesh.folder / "probed.yaml", config)))
    port = await stage.start("127.0.0.1", 0, health_port=0)
    orchestrator = OrchestratorServer(pipeline(mesh, "talker"), security=mesh.settings())
    await orchestrator.start("127.0.0.1", 0, health_port=0)
    try:
        assert await stage.wait_ready()
        await orchestrator.wait_ready(timeout_s=60)
        assert stage.health_port not in (None, port)
        for probe_port, ready_name in (
            (stage.health_port, "omni.v1.Stage"),
            (orchestrator.health_port, "omni.v1.Orchestrator"),
        ):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{probe_port}") as channel:
                health_stub = health_pb2_grpc.HealthStub(channel)
                for service in (ready_name, "liveness"):
                    reply = await health_stub.Check(
                        health_pb2.HealthCheckRequest(service=service), timeout=5
                    )
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
                for method in (
                    "/omni.v1.Stage/Describe",
                    "/omni.v1.Orchestrator/Describe",
                    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                ):
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await channel.unary_unary(method)(b"", timeout=5)
                    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED, method
        # The main port itself still takes no plaintext caller.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="liveness"), timeout=5
                )
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await orchestrator.stop()
        await stage.stop()
