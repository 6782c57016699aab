"""Issue 19, "Under siege": what one caller's request ids can do to another's, on
the hostile mesh (client tokens at the orchestrator, the mesh token at the stage).

- A request id is its caller's: bob's Generate under alice's in-flight id runs as
  his own request, and nothing in his answer tells him hers exists; his Abort of
  that id finds nothing of hers. Only alice's own duplicate is refused.
- Abort checks its ids before it answers: its reply can never be made large.
"""

from __future__ import annotations

import grpc
import pytest

from services.mesh.pb.omni.v1 import stage_pb2
from tests.hostile.conftest import Mesh


async def test_one_callers_ids_neither_collide_with_nor_reveal_anothers(mesh: Mesh) -> None:
    async with mesh.client("alice") as alice, mesh.client("bob") as bob:
        theirs = aiter(
            alice.generate("Tell a long story.", request_id="shared-1", params={"max_tokens": 400})
        )
        assert (await anext(theirs)).WhichOneof("kind") == "segment"
        # bob under the same id: his own request, answered under his id, in full.
        mine = await bob.generate(
            "Say hi.", request_id="shared-1", params={"max_tokens": 3, "temperature": 0.0}
        ).collect()
        assert mine.ok, mine.done
        assert mine.done is not None and mine.done.request_id == "shared-1"
        assert len(mine.stages["thinker"].token_ids) == 3
        assert "alice" not in str(mine.done) and "in flight" not in str(mine.done)
        # His Abort of that id finds nothing (his own has ended); hers runs on.
        reply = await bob.abort("shared-1")
        assert list(reply.not_found) == ["shared-1"] and not reply.aborted
        # alice's own duplicate is refused; her first request is untouched.
        again = await alice.generate("Hi", request_id="shared-1").collect()
        assert again.done is not None and again.done.code_name == "INVALID_ARGUMENT"
        reply = await alice.abort("shared-1")
        assert list(reply.aborted) == ["shared-1"]
        rest = [event async for event in theirs]
        assert rest[-1].done.code_name == "CANCELLED"
        assert rest[-1].done.request_id == "shared-1"
    await mesh.control("after-shared-ids")


@pytest.mark.parametrize(
    ("ids", "field"),
    [
        (["x" * 10_000], "request_ids[0]"),  # longer than any request id may be
        (["ok", "bad\nid"], "request_ids[1]"),  # not printable
        ([f"id-{n}" for n in range(1_000)], "request_ids"),  # more than one Abort may name
    ],
    ids=["a 10 KB id", "an unprintable id", "a thousand ids"],
)
async def test_abort_refuses_ids_it_would_echo(mesh: Mesh, ids: list[str], field: str) -> None:
    async with mesh.client("alice") as alice:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await alice.stub.Abort(stage_pb2.AbortRequest(request_ids=ids), metadata=alice.metadata)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (refused.value.details() or "").startswith(f"{field}:")
    assert len(refused.value.details() or "") < 200
    await mesh.serving()
