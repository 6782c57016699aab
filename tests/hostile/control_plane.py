"""Catalogue cases on the control plane: ownership (Abort, Cancel, request ids
of another caller), ReleaseTensors of blocks that are not the caller's, Pause
without an admin token. Each returns its Outcome after checking that the
victim (alice's request, the victim's block) is unharmed."""

from __future__ import annotations

import grpc

from orchestrator.client import make_request
from services.mesh.pb.omni.v1 import stage_pb2
from tests.hostile.cases import VICTIM, cancel, guessed, streamed, submit, victim
from tests.hostile.conftest import Mesh
from tests.hostile.senders import (
    LONG,
    Outcome,
    at_orchestrator,
    on_orchestrator_stream,
    on_stage,
)

# --- control-plane cases ------------------------------------------------------------


async def bob_aborts_alices_request(mesh: Mesh) -> Outcome:
    async with mesh.client("alice") as alice, mesh.client("bob") as bob:
        events = aiter(
            alice.generate("Tell a long story.", request_id="alice-1", params={"max_tokens": LONG})
        )
        tokens = len((await anext(events)).segment.token_ids)
        reply = await bob.abort("alice-1")
        rest = [event async for event in events]
    tokens += sum(len(e.segment.token_ids) for e in rest)
    assert rest[-1].done.code_name == "OK" and tokens == LONG, "bob's abort reached alice"
    return Outcome("NOT_FOUND" if list(reply.not_found) == ["alice-1"] else "ABORTED", "")


async def bob_cancels_alices_request(mesh: Mesh) -> Outcome:
    async with mesh.client("alice") as alice:
        events = aiter(
            alice.generate("Tell a long story.", request_id="alice-2", params={"max_tokens": LONG})
        )
        await anext(events)
        outcome = await on_orchestrator_stream(
            mesh, [streamed(cancel("alice-2"))], "alice-2", who="bob"
        )
        rest = [event async for event in events]
    assert rest[-1].done.code_name == "OK", "bob's cancel reached alice"
    return outcome


async def stranger_releases_the_victims_block(mesh: Mesh) -> Outcome:
    async with mesh.stage(None) as stranger:
        try:
            await stranger.release_tensors(
                stage_pb2.ReleaseTensorsRequest(request_id="victim", names=[mesh.victim.shm.name])
            )
        except grpc.aio.AioRpcError as exc:
            outcome = Outcome(exc.code().name, exc.details() or "")
    # The block is still there for the mesh: the victim's data opens.
    assert await on_stage(mesh, [submit(VICTIM, tensors=[victim(mesh)])], VICTIM) == Outcome(
        "OK", ""
    )
    return outcome


async def mesh_releases_guessed_names(mesh: Mesh) -> Outcome:
    names = [guessed(mesh), "../../etc/passwd", mesh.victim.shm.name + "/../x", ""]
    async with mesh.stage() as stage_client:
        reply = await stage_client.release_tensors(stage_pb2.ReleaseTensorsRequest(names=names))
    assert reply.released == 0
    assert await on_stage(mesh, [submit(VICTIM, tensors=[victim(mesh)])], VICTIM) == Outcome(
        "OK", ""
    )
    return Outcome("OK", "")


async def stranger_aborts_at_the_stage(mesh: Mesh) -> Outcome:
    async with mesh.stage(None) as stranger:
        try:
            await stranger.abort("victim")
        except grpc.aio.AioRpcError as exc:
            return Outcome(exc.code().name, exc.details() or "")
    return Outcome("OK", "")


async def alice_pauses(mesh: Mesh) -> Outcome:
    async with mesh.client("alice") as alice:
        try:
            await alice.pause()
        except grpc.aio.AioRpcError as exc:
            return Outcome(exc.code().name, exc.details() or "")
    return Outcome("OK", "")


async def abort_unknown_at_orchestrator(mesh: Mesh) -> Outcome:
    async with mesh.client("alice") as alice:
        reply = await alice.abort("nobody", "nobody-else")
    assert list(reply.not_found) == ["nobody", "nobody-else"]
    return Outcome("NOT_FOUND", "")


async def bob_reuses_alices_request_id(mesh: Mesh, *, on_stream: bool) -> Outcome:
    """Ids are each caller's own: bob's request under alice's in-flight id is his,
    and runs (issue 19: it was refused "'alice-dup-0' is already in flight")."""
    rid = f"alice-dup-{int(on_stream)}"
    async with mesh.client("alice") as alice:
        events = aiter(
            alice.generate("Tell a long story.", request_id=rid, params={"max_tokens": LONG})
        )
        tokens = len((await anext(events)).segment.token_ids)
        if on_stream:
            outcome = await on_orchestrator_stream(mesh, [streamed(submit(rid))], rid, who="bob")
        else:
            request = make_request("Hi", request_id=rid, params={"max_tokens": 2})
            outcome = await at_orchestrator(mesh, request, who="bob")
        rest = [event async for event in events]
    tokens += sum(len(e.segment.token_ids) for e in rest)
    assert rest[-1].done.code_name == "OK" and tokens == LONG, "bob's request reached alice's"
    return outcome


async def abort_huge_ids(mesh: Mesh) -> Outcome:
    """The orchestrator refuses ids it would echo (issue 19: 1,000 of 10 KB made a
    10 MB reply); the stage answers only the mesh."""
    ids = ["x" * 10_240, "", "\0"]
    async with mesh.client("alice") as alice, mesh.stage() as stage_client:
        at_stage = await stage_client.abort(*ids)
        released = await stage_client.release_tensors(
            stage_pb2.ReleaseTensorsRequest(request_id="x" * 10_240)
        )
        assert list(at_stage.not_found) == ids and released.released == 0
        try:
            reply = await alice.abort(*ids)
        except grpc.aio.AioRpcError as exc:
            return Outcome(exc.code().name, exc.details() or "")
    raise AssertionError(f"the orchestrator echoed the ids: {len(reply.not_found)} of them")
