"""What issue 19 added to the chart: a generated mesh token, on by default, so
stages serve the mesh alone even where a NetworkPolicy is not enforced (a named
auth secret replaces it, `auth.meshToken: false` turns it off); and the
pipeline's `runtime` limits passed to the orchestrator."""

from __future__ import annotations

import base64

from orchestrator.server.pipeline import parse_pipeline
from tests.deploy.chart import render
from tests.deploy.manifests import TLS, by_kind, config_file, containers


def test_the_mesh_token_is_on_by_default_from_a_generated_secret() -> None:
    docs = render()
    (secret,) = by_kind(docs, "Secret").values()
    assert secret["metadata"]["name"] == "omni-mesh-token"
    assert len(base64.b64decode(secret["data"]["mesh-token"])) == 48
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    for name, (container, spec) in containers(docs).items():
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["OMNI_MESH_TOKEN_FILE"] == "/etc/omni/auth/mesh-token", name
        assert "OMNI_TOKENS_FILE" not in env, name  # the front door: no client tokens given
        (auth,) = [v for v in spec["volumes"] if v["name"] == "auth"]
        assert auth["secret"] == {
            "secretName": "omni-mesh-token",
            "items": [{"key": "mesh-token", "path": "mesh-token"}],
        }
    off = render({"auth": {"meshToken": False}})
    assert not by_kind(off, "Secret")
    for container, _ in containers(off).values():
        assert not any(e["name"] == "OMNI_MESH_TOKEN_FILE" for e in container["env"])
    assert not by_kind(render(TLS), "Secret")  # the named secret holds it


def test_the_pipeline_runtime_reaches_the_orchestrator() -> None:
    runtime = {"max_message_bytes": 16 << 20, "connections": {"max_connections": 1024}}
    docs = render({"pipeline": {"runtime": runtime}})
    pipeline = parse_pipeline(config_file(docs, "omni-pipeline", "pipeline.yaml"), "rendered")
    assert pipeline.runtime.max_message_bytes == 16 << 20
    assert pipeline.runtime.connections.max_connections == 1024
