"""CUDA IPC hand-offs: CPU-checkable refusals here, real GPU processes when there is one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.mesh.data.node import node_identity
from services.mesh.errors import FailedPrecondition, InvalidArgument
from services.mesh.pb.omni.v1 import tensor_pb2
from services.mesh.tensors.cuda_ipc import CudaIpcProducer, open_cuda, ref_name

REPO = Path(__file__).resolve().parents[2]
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA IPC needs a CUDA GPU; none is visible"
)


def ref(**changes: object) -> tensor_pb2.Tensor:
    cuda = tensor_pb2.CudaIpcRef(
        handle=b"\x01" * 64,
        device_uuid="GPU-00000000-0000-0000-0000-000000000000",
        nbytes=16,
        storage_nbytes=16,
        producer=node_identity(),
    )
    for key, value in changes.items():
        setattr(cuda, key, value)
    return tensor_pb2.Tensor(dtype="float32", shape=[4], cuda_ipc=cuda)


def test_a_gpu_this_process_cannot_see_fails_its_precondition() -> None:
    with pytest.raises(FailedPrecondition) as err:
        open_cuda(ref(), field="inputs[0]")
    assert err.value.field == "inputs[0].cuda_ipc.device_uuid"
    assert "cannot see GPU" in err.value.message


def test_refs_that_disagree_or_come_from_elsewhere_are_refused() -> None:
    with pytest.raises(InvalidArgument) as err:
        open_cuda(ref(nbytes=12), field="t")
    assert err.value.field == "t.cuda_ipc.nbytes"
    with pytest.raises(InvalidArgument):
        open_cuda(ref(storage_nbytes=8), field="t")
    far = ref()
    far.cuda_ipc.producer.boot_id = "another-machine"
    with pytest.raises(FailedPrecondition, match="another node"):
        open_cuda(far, field="t")


def test_ref_names_are_stable_and_tell_allocations_apart() -> None:
    a, b = ref().cuda_ipc, ref(offset=512).cuda_ipc
    assert ref_name(a) == ref_name(ref().cuda_ipc) != ref_name(b)
    assert ref_name(a).startswith("cuda-")


def test_sharing_a_cpu_tensor_is_a_bug() -> None:
    with pytest.raises(ValueError, match="CUDA tensors"):
        CudaIpcProducer().share(torch.zeros(4), "r")


PRODUCER = """
import sys, torch
from services.mesh.tensors.cuda_ipc import CudaIpcProducer
device = sys.argv[1]
cuda = CudaIpcProducer()
baseline = torch.cuda.memory_allocated(device)
x = torch.arange(1 << 20, dtype=torch.float32, device=device).view(1024, 1024)
for t in (x, x[:, :512]):  # whole, and a strided view (shared as a compact copy)
    print(cuda.share(t, "req").SerializeToString().hex(), float(t.double().sum()), flush=True)
del x, t
sys.stdin.readline()  # the consumer is done and gone
held = torch.cuda.memory_allocated(device) - baseline
released = cuda.release("req")
torch.cuda.ipc_collect()
print(held, released, torch.cuda.memory_allocated(device) - baseline, flush=True)
"""
CONSUMER = """
import sys, torch
from services.mesh.tensors.cuda_ipc import open_cuda
from services.mesh.errors import FailedPrecondition
from services.mesh.pb.omni.v1 import tensor_pb2
for line in sys.stdin:
    try:
        t = open_cuda(tensor_pb2.Tensor.FromString(bytes.fromhex(line)), field="t")
    except FailedPrecondition as exc:
        print("refused", exc.field, flush=True)
        continue
    print(t.device, list(t.shape), float(t.double().sum()), flush=True)
    del t
torch.cuda.synchronize()
"""


def run_pair(
    producer_device: str, consumer_env: dict[str, str]
) -> tuple[list[str], list[str], str]:
    """(producer's ref lines, consumer's lines, producer's memory line)."""
    producer = subprocess.Popen(
        [sys.executable, "-c", PRODUCER, producer_device],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert producer.stdin and producer.stdout
    try:
        shared = [producer.stdout.readline().split() for _ in range(2)]
        consumer = subprocess.run(
            [sys.executable, "-c", CONSUMER],
            cwd=REPO,
            input="".join(f"{ref}\n" for ref, _ in shared),
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, **consumer_env},
        )
        assert consumer.returncode == 0, consumer.stderr
        producer.stdin.write("done\n")
        producer.stdin.flush()
        return [s for _, s in shared], consumer.stdout.splitlines(), producer.stdout.readline()
    finally:
        producer.kill()
        producer.wait()


@pytest.mark.gpu
@needs_gpu
def test_a_tensor_crosses_processes_and_release_frees_it() -> None:
    sums, seen, memory = run_pair("cuda:0", {})
    assert seen == [
        f"cuda:0 [1024, 1024] {sums[0]}",
        f"cuda:0 [1024, 512] {sums[1]}",
    ]
    held, released, after = (int(v) for v in memory.split())
    assert held >= (4 << 20) + (2 << 20) and released == 2
    assert after == 0  # torch freed both once released and the consumer let go


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="renumbering by CUDA_VISIBLE_DEVICES needs two CUDA GPUs",
)
def test_devices_are_matched_by_uuid_not_by_index() -> None:
    sums, seen, _ = run_pair("cuda:1", {"CUDA_VISIBLE_DEVICES": "1"})
    assert seen[0] == f"cuda:0 [1024, 1024] {sums[0]}"
    _, seen, _ = run_pair("cuda:1", {"CUDA_VISIBLE_DEVICES": "0"})
    assert seen[0] == "refused t.cuda_ipc.device_uuid"
