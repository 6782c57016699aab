"""The OMNI_* variables: each parsed to its type or refused naming it, the same
in a process started as a user starts one, and docs/configuration.md's table kept alike."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.mesh import environment
from services.mesh.environment import BadVariable, Variable
from services.mesh.security import SecuritySettings
from services.mesh.telemetry import tracing

OMNI = str(Path(sys.executable).parent / "omni")
REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "configuration.md"


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        (environment.PROMETHEUS_PORT, "abc", "expected a port 1-65535, got 'abc'"),
        (environment.PROMETHEUS_PORT, "70000", "expected a port 1-65535, got '70000'"),
        (environment.MESH_ID, "Bad/Mesh", "mesh id 'Bad/Mesh': expected 1-31 of a-z"),
        (environment.MAX_PAUSE_S, "-1", "expected a number of seconds > 0, got '-1'"),
        (environment.MAX_PAUSE_S, "soon", "expected a number of seconds > 0, got 'soon'"),
        (environment.LOG_LEVEL, "loud", "expected a level (DEBUG, INFO, WARNING, ERROR)"),
        (environment.PARENT_PID, "init", "expected a process id, got 'init'"),
    ],
)
def test_a_bad_value_is_refused_naming_the_variable(
    variable: Variable[object], value: str, expected: str
) -> None:
    with pytest.raises(BadVariable) as refused:
        variable.get({variable.name: value})
    assert str(refused.value).startswith(f"{variable.name}: {expected}")


def test_values_are_typed_and_unset_is_the_default() -> None:
    assert environment.PROMETHEUS_PORT.get({"OMNI_PROMETHEUS_PORT": "9464"}) == 9464
    assert environment.PROMETHEUS_PORT.get({}) is None
    # Empty: unset where an optional secret may be mounted empty, else a value to check.
    assert environment.TLS_CERT.get({"OMNI_TLS_CERT": ""}) is None
    assert environment.CACHE_DIR.get({"OMNI_CACHE_DIR": ""}) == environment.CACHE_DIR.default
    with pytest.raises(BadVariable, match=r"^OMNI_MESH_ID: mesh id ''"):
        environment.MESH_ID.get({"OMNI_MESH_ID": ""})
    assert environment.MAX_PAUSE_S.get({"OMNI_MAX_PAUSE_S": "2.5"}) == 2.5
    assert environment.LOG_LEVEL.get({"OMNI_LOG_LEVEL": "debug"}) == "DEBUG"
    assert environment.LOG_LEVEL.get({}) == "INFO"
    assert environment.TLS_CA.get({"OMNI_TLS_CA": "/etc/ca.pem"}) == Path("/etc/ca.pem")
    assert environment.MESH_ID.get({}) == "default"
    # The Kubernetes downward API's usual name stands in for ours.
    assert environment.NODE_NAME.get({"NODE_NAME": "node-7"}) == "node-7"
    assert environment.NODE_NAME.get({"NODE_NAME": "b", "OMNI_NODE_NAME": "a"}) == "a"


def test_the_readers_refuse_a_bad_value_naming_it() -> None:
    with pytest.raises(ValueError, match=r"^OMNI_PROMETHEUS_PORT: expected a port"):
        tracing.setup("omni-test", env={"OMNI_PROMETHEUS_PORT": "abc"})
    with pytest.raises(BadVariable, match=r"^OMNI_MAX_PAUSE_S: "):
        SecuritySettings().with_env({"OMNI_MAX_PAUSE_S": "0"})
    assert SecuritySettings().with_env({"OMNI_MAX_PAUSE_S": "7"}).max_pause_s == 7.0


def test_the_documented_table_is_the_module() -> None:
    section = DOC.read_text().split("\n## Environment\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        row = re.fullmatch(r"\| `(OMNI_[A-Z_]+)` \| ([^|]+) \| ([^|]+) \| (.+) \|", line)
        if row:
            rows[row[1]] = (row[2].strip(), row[3].strip(), row[4].strip())
    expected = {v.name: (v.read_by, v.shown_default, v.meaning) for v in environment.VARIABLES}
    assert rows == expected


def test_no_module_reads_an_omni_variable_but_the_environment_module() -> None:
    root = REPO
    readers = [
        str(path.relative_to(root))
        for folder in ("services", "orchestrator")
        for path in (root / folder).rglob("*.py")
        if re.search(r"(\.get\(|environ\[|getenv\()\s*['\"]OMNI_", path.read_text())
    ]
    assert readers == []


def omni(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [OMNI, *args], capture_output=True, text=True, timeout=120, env={**os.environ, **env}
    )


def test_processes_honour_the_variables(tmp_path: Path) -> None:
    pipeline = tmp_path / "pipe.yaml"
    pipeline.write_text(
        yaml.safe_dump({"name": "p", "stages": [{"name": "a", "address": "127.0.0.1:1"}]})
    )
    serve = ("orchestrator", "serve", "--pipeline", str(pipeline), "--port", "0")
    for name, value, expected in [
        ("OMNI_PROMETHEUS_PORT", "abc", "expected a port 1-65535, got 'abc'"),
        ("OMNI_MAX_PAUSE_S", "-1", "expected a number of seconds > 0, got '-1'"),
    ]:
        done = omni(*serve, env={name: value})
        assert done.returncode == 2, done.stderr
        assert f"omni orchestrator: {name}: {expected}" in done.stderr
        assert "Traceback" not in done.stderr
    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"
    done = omni("generate", "hi", "--timeout", "5", env={"OMNI_ADDRESS": address})
    assert done.returncode == 1 and f"omni generate: {address}: " in done.stderr, done.stderr
