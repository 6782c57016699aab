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


# KEDA's externalscaler.proto (github.com/kedacore/keda, pkg/scalers/externalscaler),
# field by field: KEDA's Go client sends and reads exactly these numbers and types.
KEDA_MESSAGES = {
    "ScaledObjectRef": [
        ("name", 1, "string"),
        ("namespace", 2, "string"),
        ("scalerMetadata", 3, "map<string, string>"),
    ],
    "IsActiveResponse": [("result", 1, "bool")],
    "GetMetricSpecResponse": [("metricSpecs", 1, "repeated MetricSpec")],
    "MetricSpec": [
        ("metricName", 1, "string"),
        ("targetSize", 2, "int64"),
        ("targetSizeFloat", 3, "double"),
    ],
    "GetMetricsRequest": [("scaledObjectRef", 1, "ScaledObjectRef"), ("metricName", 2, "string")],
    "GetMetricsResponse": [("metricValues", 1, "repeated MetricValue")],
    "MetricValue": [
        ("metricName", 1, "string"),
        ("metricValue", 2, "int64"),
        ("metricValueFloat", 3, "double"),
    ],
}
KEDA_METHODS = {  # name: (request, response, server streaming)
    "IsActive": ("ScaledObjectRef", "IsActiveResponse", False),
    "StreamIsActive": ("ScaledObjectRef", "IsActiveResponse", True),
    "GetMetricSpec": ("ScaledObjectRef", "GetMetricSpecResponse", False),
    "GetMetrics": ("GetMetricsRequest", "GetMetricsResponse", False),
}


def test_the_external_scaler_proto_is_kedas_field_for_field() -> None:
    from google.protobuf.descriptor import FieldDescriptor

    from services.mesh.pb.externalscaler import externalscaler_pb2

    scalars = {
        FieldDescriptor.TYPE_STRING: "string",
        FieldDescriptor.TYPE_BOOL: "bool",
        FieldDescriptor.TYPE_INT64: "int64",
        FieldDescriptor.TYPE_DOUBLE: "double",
    }

    def kind(field: FieldDescriptor) -> str:
        message = field.message_type
        if message is not None and message.GetOptions().map_entry:
            key, value = (kind(message.fields_by_name[n]) for n in ("key", "value"))
            return f"map<{key}, {value}>"
        name = message.name if message is not None else scalars[field.type]
        return f"repeated {name}" if field.is_repeated else name

    file = externalscaler_pb2.DESCRIPTOR
    assert file.package == "externalscaler"
    shipped = {
        name: [(f.name, f.number, kind(f)) for f in message.fields]
        for name, message in file.message_types_by_name.items()
    }
    assert shipped == KEDA_MESSAGES
    (service,) = file.services_by_name.values()
    assert service.full_name == "externalscaler.ExternalScaler"
    methods = {
        m.name: (m.input_type.name, m.output_type.name, m.server_streaming) for m in service.methods
    }
    assert methods == KEDA_METHODS
    assert not any(m.client_streaming for m in service.methods)
