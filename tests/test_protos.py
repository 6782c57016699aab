"""The committed stubs are exactly what protos/ generates."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(root / "protos" / "generate.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_committed_stubs_match_the_protos() -> None:
    done = check(REPO)
    assert done.returncode == 0, done.stderr


def test_the_check_fails_when_a_proto_changes(tmp_path: Path) -> None:
    shutil.copytree(REPO / "protos", tmp_path / "protos")
    shutil.copytree(REPO / "services" / "mesh" / "pb", tmp_path / "services" / "mesh" / "pb")
    proto = tmp_path / "protos" / "omni" / "v1" / "stage.proto"
    proto.write_text(proto.read_text() + "\nmessage Drift { string field = 1; }\n")
    done = check(tmp_path)
    assert done.returncode == 1
    assert "services/mesh/pb/omni/v1/stage_pb2.py" in done.stderr


def test_the_shipped_health_proto_is_the_one_our_servers_speak(tmp_path: Path) -> None:
    from google.protobuf import descriptor_pb2
    from grpc_health.v1 import health_pb2
    from grpc_tools import protoc

    out = tmp_path / "health.pb"
    args = ["protoc", f"-I{REPO / 'protos'}", f"--descriptor_set_out={out}"]
    assert protoc.main([*args, "grpc/health/v1/health.proto"]) == 0
    shipped = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    served = descriptor_pb2.FileDescriptorProto()
    health_pb2.DESCRIPTOR.CopyToProto(served)
    assert shipped.package == served.package == "grpc.health.v1"

    def fields(message: descriptor_pb2.DescriptorProto) -> None:
        for field in message.field:
            field.ClearField("json_name")  # protoc fills it in; the runtime copy omits it
        for nested in message.nested_type:
            fields(nested)

    for message in shipped.message_type:
        fields(message)
    assert list(shipped.message_type) == list(served.message_type)
    assert list(shipped.service) == list(served.service)
