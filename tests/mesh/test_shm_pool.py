"""The shared-block pool: real /dev/shm files, real subprocesses, nothing mocked.

Blocks of a MiB or more are pre-faulted, reused across requests under a fresh
name each time, bounded, unlinked at close and swept once their process dies.
"""

from __future__ import annotations

import gc
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.mesh.data.shm_pool import MIN_CLASS, size_class
from services.mesh.errors import FailedPrecondition
from services.mesh.tensors.shm import ShmProducer, open_tensor, sweep
from tests.helpers.shm_blocks import block_path, blocks_of

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20


def inodes_of(mesh: str) -> set[int]:
    return {block_path(mesh, n).stat().st_ino for n in blocks_of(mesh)}


def floats(nbytes: int, value: float) -> torch.Tensor:
    return torch.full((nbytes // 4,), value)


def test_size_classes_are_powers_of_two_from_a_mib() -> None:
    assert [size_class(n) for n in (0, 1, MIB, MIB + 1, 3 * MIB, 4 * MIB)] == [
        MIB,
        MIB,
        MIB,
        2 * MIB,
        4 * MIB,
        4 * MIB,
    ]
    assert MIN_CLASS == MIB


def test_a_second_request_reuses_the_block_without_a_new_file(
    producer: ShmProducer, mesh: str
) -> None:
    first = producer.put(floats(3 * MIB, 1.0), "req-1")
    got = open_tensor(first, mesh_id=mesh, request_id="req-1", field="t")
    assert torch.equal(got, floats(3 * MIB, 1.0))
    block = block_path(mesh, first.shm.name)
    inode = block.stat().st_ino
    # Made whole and pre-faulted: the 4 MiB class is allocated, not sparse.
    assert block.stat().st_size == 4 * MIB and block.stat().st_blocks * 512 >= 4 * MIB
    assert producer.release("req-1") == 1
    before = inodes_of(mesh)
    assert before == {inode}  # kept for reuse, not unlinked

    second = producer.put(floats(4 * MIB - 4, 2.0), "req-2")  # same class, other size
    assert inodes_of(mesh) == before  # no new /dev/shm file
    assert block_path(mesh, second.shm.name).stat().st_ino == inode
    assert second.shm.name != first.shm.name
    got = open_tensor(second, mesh_id=mesh, request_id="req-2", field="t")
    assert torch.equal(got, floats(4 * MIB - 4, 2.0))


def test_the_old_name_no_longer_opens_or_releases_after_reuse(
    producer: ShmProducer, mesh: str
) -> None:
    old = producer.put(floats(2 * MIB, 1.0), "req-1")
    producer.release("req-1")
    new = producer.put(floats(2 * MIB, 5.0), "req-2")
    # The previous consumer still knows the old name: it names nothing now.
    with pytest.raises(FailedPrecondition) as err:
        open_tensor(old, mesh_id=mesh, request_id="req-1", field="t")
    assert "gone" in err.value.message
    assert producer.release(names=[old.shm.name]) == 0
    assert producer.live_names == [new.shm.name]
    assert open_tensor(new, mesh_id=mesh, request_id="req-2", field="t")[0].item() == 5.0
    # Free blocks, too, are out of reach under the name they were last handed out by.
    producer.release("req-2")
    with pytest.raises(FailedPrecondition):
        open_tensor(new, mesh_id=mesh, request_id="req-2", field="t")


def test_blocks_beyond_the_bound_are_unlinked_on_release(mesh: str) -> None:
    with ShmProducer(mesh, pool_bytes=2 * MIB) as shm:
        refs = [shm.put(floats(2 * MIB, float(i)), f"req-{i}") for i in range(3)]
        assert len(blocks_of(mesh)) == 3
        assert shm.release("req-0") == shm.release("req-1") == shm.release("req-2") == 1
        assert shm.pool is not None and shm.pool.free_bytes == 2 * MIB
        assert len(blocks_of(mesh)) == 1  # one pooled, two unlinked
        assert not any(block_path(mesh, r.shm.name).exists() for r in refs)
    assert blocks_of(mesh) == []


def test_no_pool_when_its_bound_is_zero(mesh: str) -> None:
    with ShmProducer(mesh, pool_bytes=0) as shm:
        msg = shm.put(floats(2 * MIB, 1.0), "r")
        assert block_path(mesh, msg.shm.name).stat().st_size == 2 * MIB  # exact, as before
        shm.release("r")
        assert blocks_of(mesh) == []


def test_close_unlinks_free_and_handed_out_blocks(mesh: str) -> None:
    shm = ShmProducer(mesh)
    shm.put(floats(MIB, 1.0), "a")
    shm.put(floats(2 * MIB, 1.0), "b")
    shm.release("a")
    kept = shm.allocate("c", (4 * MIB,), torch.uint8)  # another class: a third file
    assert len(blocks_of(mesh)) == 3
    shm.close()
    assert blocks_of(mesh) == []
    kept.fill_(1)  # the producer's own view outlives the name
    assert int(kept.sum()) == 4 * MIB


def test_expired_blocks_are_unlinked_not_reused(mesh: str) -> None:
    now = [0.0]
    with ShmProducer(mesh, ttl_s=10.0, clock=lambda: now[0]) as shm:
        msg = shm.put(floats(2 * MIB, 1.0), "r")
        now[0] = 11.0
        assert shm.expire() == 1
        assert blocks_of(mesh) == [] and shm.pool is not None and shm.pool.free_bytes == 0
        with pytest.raises(FailedPrecondition):
            open_tensor(msg, mesh_id=mesh, request_id="r", field="t")


def test_an_allocated_block_is_shared_in_place_without_a_copy(
    producer: ShmProducer, mesh: str
) -> None:
    out = producer.allocate("req-1", (256, 1024), torch.float32)  # 1 MiB
    out.copy_(torch.arange(256 * 1024, dtype=torch.float32).view(256, 1024))
    ref = producer.share(out, "req-1")
    assert ref is not None and ref.shm.offset == 0 and list(ref.shape) == [256, 1024]
    assert producer.share(out, "req-2") is None  # another request's block: not by ref
    assert producer.share(out.t(), "req-1") is None  # not contiguous: put copies it
    # A view into the block is sent as its slice.
    rows = producer.share(out[128:], "req-1")
    assert rows is not None and rows.shm.name == ref.shm.name
    assert rows.shm.offset == 128 * 1024 * 4
    assert open_tensor(rows, mesh_id=mesh, request_id="req-1", field="t")[0, 0].item() == 128 * 1024
    # No copy: what the producer writes after sharing is what the consumer reads.
    out[0, 0] = -1.0
    assert open_tensor(ref, mesh_id=mesh, request_id="req-1", field="t")[0, 0].item() == -1.0
    # Released while the producer still holds its view: not reused until the view dies.
    assert producer.release("req-1") == 1
    assert producer.pool is not None and producer.pool.free_bytes == 0
    assert block_path(mesh, ref.shm.name).exists()
    del out
    gc.collect()
    assert producer.pool.free_bytes == MIB
    assert not block_path(mesh, ref.shm.name).exists() and producer.live_names == []


def test_an_allocated_block_never_shared_returns_when_its_views_die(
    producer: ShmProducer, mesh: str
) -> None:
    out = producer.allocate("req-1", (3, MIB // 2), torch.uint8)  # 1.5 MiB: class 2 MiB
    assert producer.live_names and producer.pool is not None
    del out
    gc.collect()
    assert producer.live_names == [] and producer.pool.free_bytes == 2 * MIB
    again = producer.allocate("req-2", (2 * MIB,), torch.uint8)
    assert len(blocks_of(mesh)) == 1  # the same file
    assert again.shape == (2 * MIB,)


PRODUCER = """
import sys, time, torch
from services.mesh.tensors.shm import ShmProducer
shm = ShmProducer(sys.argv[1])
shm.put(torch.ones(1 << 19), "old")
shm.release("old")  # now a free block of the pool
live = shm.allocate("new", (1 << 23,), torch.uint8)  # another class
print(shm.put(torch.ones(1 << 20), "new").shm.name, flush=True)
time.sleep(120)
"""


@pytest.mark.slow  # a subprocess that imports torch
def test_the_pool_is_swept_after_its_producer_is_killed(mesh: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", PRODUCER, mesh], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    try:
        proc.stdout.readline()
        assert len(blocks_of(mesh)) == 3  # free, allocated, put
        assert sweep(mesh, every_mesh=False) == []  # alive: nothing is stale
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        leftovers = blocks_of(mesh)
        assert len(leftovers) == 3
        assert sorted(sweep(mesh, every_mesh=False)) == leftovers
        assert blocks_of(mesh) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
