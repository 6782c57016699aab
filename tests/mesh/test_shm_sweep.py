"""The mesh's shared-memory directory and the sweep: real /dev/shm, real
processes as another user and in other PID namespaces, nothing mocked.

Blocks are not listable or openable by another local user, and the sweep never
removes a block whose producer lives, wherever that producer's pid lives; what
a killed producer left is removed."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.mesh.data.shm_dir import SHM_ROOT, mesh_dir, sweep
from services.mesh.data.shm_names import BLOCK_NAME, PRODUCER_HEX, block_name
from services.mesh.errors import FailedPrecondition
from services.mesh.pb.omni.v1 import tensor_pb2
from services.mesh.tensors.shm import ShmProducer, open_tensor
from tests.helpers.shm_blocks import block_path, blocks_of, remove_mesh
from tests.mesh.test_shm import bad_ref, made_name

REPO = Path(__file__).resolve().parents[2]
ROOT_ONLY = pytest.mark.skipif(
    os.geteuid() != 0, reason="runs processes as another uid or in new PID namespaces: needs root"
)
NEEDS_UNSHARE = pytest.mark.skipif(
    shutil.which("unshare") is None, reason="needs util-linux unshare for a new PID namespace"
)
NOBODY = 65534


def test_blocks_live_in_a_directory_only_their_uid_can_enter(
    producer: ShmProducer, mesh: str
) -> None:
    msg = producer.put(torch.ones(8), "r")
    info = os.lstat(mesh_dir(mesh))
    assert info.st_uid == os.geteuid() and info.st_mode & 0o777 == 0o700
    assert block_path(mesh, msg.shm.name).exists()
    assert not any(msg.shm.name in name for name in os.listdir(SHM_ROOT))


@ROOT_ONLY
def test_another_user_can_neither_list_nor_open_a_block(producer: ShmProducer, mesh: str) -> None:
    names = [producer.put(torch.full((64,), float(i)), f"r{i}").shm.name for i in range(3)]
    path = block_path(mesh, names[0])
    seen = subprocess.run(
        ["find", str(SHM_ROOT)], user=NOBODY, group=NOBODY, capture_output=True, text=True
    )
    assert str(mesh_dir(mesh)) in seen.stdout  # the directory shows, what is in it does not
    assert not any(name in seen.stdout for name in names)
    assert f"{mesh_dir(mesh)}" in seen.stderr and "Permission denied" in seen.stderr
    read = subprocess.run(["head", "-c", "4", str(path)], user=NOBODY, capture_output=True)
    assert read.returncode != 0 and read.stdout == b"" and b"Permission denied" in read.stderr


@pytest.fixture
def foreign_dir(mesh: str) -> Iterator[Path]:
    """``mesh``'s directory made by someone else first, open to everyone."""
    path = mesh_dir(mesh)
    path.mkdir()
    path.chmod(0o777)
    yield path
    remove_mesh(mesh)


def test_a_directory_open_to_others_is_neither_written_nor_read(
    foreign_dir: Path, mesh: str
) -> None:
    planted = foreign_dir / made_name(mesh)
    planted.write_bytes(b"\x01" * 16)  # a block someone else put there for us to read
    with pytest.raises(FailedPrecondition, match="not private"):
        ShmProducer(mesh)
    with pytest.raises(FailedPrecondition, match="not private") as err:
        open_tensor(bad_ref(planted.name), mesh_id=mesh, request_id="r", field="t")
    assert err.value.field == "t.shm.name"
    assert sweep(mesh) == [] and planted.exists()  # not ours to sweep either


def test_a_link_in_place_of_the_directory_is_refused(mesh: str, tmp_path: Path) -> None:
    mesh_dir(mesh).symlink_to(tmp_path, target_is_directory=True)
    try:
        with pytest.raises(FailedPrecondition, match="a link or not a directory"):
            ShmProducer(mesh)
        with pytest.raises(FailedPrecondition, match="a link") as err:
            open_tensor(bad_ref(made_name(mesh)), mesh_id=mesh, request_id="r", field="t")
        assert err.value.field == "t.shm.name"
        assert sweep(mesh) == [] and list(tmp_path.iterdir()) == []
    finally:
        mesh_dir(mesh).unlink()


@ROOT_ONLY
def test_a_directory_owned_by_another_user_is_refused(foreign_dir: Path, mesh: str) -> None:
    foreign_dir.chmod(0o700)
    os.chown(foreign_dir, NOBODY, NOBODY)
    with pytest.raises(FailedPrecondition, match=f"owner uid {NOBODY}"):
        ShmProducer(mesh)


def dead_producer(mesh: str, count: int) -> list[str]:
    """What a producer that died leaves: its lock file, which nobody holds any
    more, a free pooled block and ``count`` blocks of requests."""
    token = secrets.token_hex(PRODUCER_HEX // 2)
    folder = mesh_dir(mesh)
    folder.mkdir(mode=0o700, exist_ok=True)
    (folder / f"{token}.lock").touch()
    names = [
        block_name(mesh, token, None),
        *(block_name(mesh, token, f"q{i}") for i in range(count)),
    ]
    for name in names:
        (folder / name).write_bytes(b"x")
    return sorted(names)


def test_sweep_spares_live_producers_and_takes_what_dead_ones_left(
    producer: ShmProducer, mesh: str
) -> None:
    producer.put(torch.zeros(8), "r")
    producer.put(torch.zeros(1 << 18), "p")  # a MiB: pooled
    producer.release("p")  # now a free block of the pool: as live as the rest
    alive = blocks_of(mesh)
    assert len(alive) == 2
    dead = dead_producer(mesh, 2)
    orphans = dead_producer(mesh, 1)
    token = BLOCK_NAME.fullmatch(orphans[0])
    assert token is not None
    (mesh_dir(mesh) / f"{token['producer']}.lock").unlink()  # a sweep stopped half-way
    (mesh_dir(mesh) / "notes.txt").write_text("not a block")
    other = f"{mesh}-x"
    gone_mesh = dead_producer(other, 1)
    try:
        assert sorted(sweep(mesh, every_mesh=False)) == sorted(dead + orphans)
        assert blocks_of(mesh) == alive and blocks_of(other) == gone_mesh
        assert set(gone_mesh) <= set(sweep(mesh))  # every mesh of this uid
        assert not mesh_dir(other).exists()  # left empty: removed
        assert blocks_of(mesh) == alive and (mesh_dir(mesh) / "notes.txt").exists()
        again = producer.put(torch.ones(4), "r")
        assert open_tensor(again, mesh_id=mesh, request_id="r", field="t").sum().item() == 4
    finally:
        remove_mesh(other)


PRODUCER = """
import sys, time, torch
from services.mesh.tensors.shm import ShmProducer
shm = ShmProducer(sys.argv[1])
shm.put(torch.ones(1 << 19), "old")
shm.release("old")  # a free pooled block
for i in range(3):
    print(shm.put(torch.full((4096,), float(i + 1)), "req").SerializeToString().hex(), flush=True)
time.sleep(120)
"""
CONSUMER = """
import sys, time
from services.mesh.pb.omni.v1 import tensor_pb2
from services.mesh.tensors.shm import open_tensor
msg = tensor_pb2.Tensor.FromString(bytes.fromhex(sys.stdin.readline()))
print(float(open_tensor(msg, mesh_id=sys.argv[1], request_id="req", field="t").sum()), flush=True)
time.sleep(120)
"""
SWEEP = """
import sys
from services.mesh.data.shm_dir import sweep
mesh = sys.argv[1]
print(sum(name.startswith(f"omni-{mesh}-") for name in sweep(mesh)), flush=True)
"""


def spawn(script: str, mesh: str, *prefix: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*prefix, sys.executable, "-c", script, mesh],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def stop(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe:
                pipe.close()


def swept_from(namespace: tuple[str, ...], mesh: str) -> int:
    """How many of ``mesh``'s blocks a sweep (of every mesh) removed, run in a
    process started with ``namespace``."""
    done = subprocess.run(
        [*namespace, sys.executable, "-c", SWEEP, mesh],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


@pytest.mark.slow  # two subprocesses that import torch
def test_sweep_removes_everything_of_killed_producers_and_consumers(mesh: str) -> None:
    # Both start at once (importing torch is most of their cost).
    producer, consumer = procs = [spawn(PRODUCER, mesh), spawn(CONSUMER, mesh)]
    assert producer.stdout and consumer.stdin and consumer.stdout
    try:
        refs = [producer.stdout.readline() for _ in range(3)]
        assert len(blocks_of(mesh)) == 4  # three handed out, one free in the pool
        consumer.stdin.write(refs[1])
        consumer.stdin.flush()
        assert consumer.stdout.readline().strip() == str(2.0 * 4096)
        assert sweep(mesh, every_mesh=False) == []  # both alive: nothing is stale yet
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        leftovers = blocks_of(mesh)
        assert len(leftovers) == 4
        assert sorted(sweep(mesh, every_mesh=False)) == leftovers
        assert blocks_of(mesh) == [] and not mesh_dir(mesh).exists()
    finally:
        stop(procs)


@ROOT_ONLY
@NEEDS_UNSHARE
@pytest.mark.slow  # a producer that imports torch, sweeps in fresh namespaces
def test_a_producer_in_another_pid_namespace_is_never_swept(mesh: str) -> None:
    # Producer and sweeper each run as pid 1 of a PID namespace of their own, as
    # containers of one Pod that share /dev/shm but not their processes.
    namespace = ("unshare", "--pid", "--fork", "--kill-child", "--mount-proc")
    producer = spawn(PRODUCER, mesh, *namespace)
    assert producer.stdout
    try:
        refs = [producer.stdout.readline() for _ in range(3)]
        assert len(blocks_of(mesh)) == 4
        for _ in range(3):
            assert swept_from(namespace, mesh) == 0
        assert sweep(mesh) == []
        assert len(blocks_of(mesh)) == 4
        msg = tensor_pb2.Tensor.FromString(bytes.fromhex(refs[2]))
        assert open_tensor(msg, mesh_id=mesh, request_id="req", field="t").sum().item() == 3 * 4096
        # Kill the producer itself (pid 1 of its namespace), not unshare: killing
        # unshare only sends its child a SIGKILL that may land after the sweep runs.
        # unshare reaps its child before it exits, so once it has, the producer is gone.
        (inner,) = Path(f"/proc/{producer.pid}/task/{producer.pid}/children").read_text().split()
        os.kill(int(inner), signal.SIGKILL)
        producer.wait()
        assert swept_from(namespace, mesh) == 4  # gone: a sweep anywhere takes its blocks
        assert blocks_of(mesh) == []
    finally:
        stop([producer])
