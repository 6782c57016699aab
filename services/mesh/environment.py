"""Every OMNI_* environment variable the mesh reads, declared once: its name, its
type, its default, who reads it and what it means (docs/configuration.md,
'Environment', is this table). Code reads a variable through its ``Variable`` only, never
``os.environ`` itself.

Each variable is read where it is used, when it is used (a test may set one and
read it again), and only that one: a process is never refused for a variable it
does not read. A value that does not parse is refused with ``BadVariable``,
naming the variable. Set but empty is unset for the variables that name files,
directories or a token (an optional secret mounted empty), and a value to check
for the others (an empty mesh id is refused). Launchers write the variables
their children read by the same names (``Variable.name``).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from services.mesh.config_files import ConfigError

T = TypeVar("T")
N = TypeVar("N", int, float)


class BadVariable(ConfigError, ValueError):
    """An environment variable whose value cannot be used; the message names it."""


@dataclass(frozen=True)
class Variable(Generic[T]):
    name: str
    parse: Callable[[str], T]  # raises ValueError with the reason for a bad value
    default: T
    read_by: str
    meaning: str
    fallback: str = ""  # another variable read when this one is unset (not OMNI_*)
    blank_is_unset: bool = False  # "" is the default, not a value to parse
    shown: str = ""  # the default as the docs show it, where the value alone does not say it

    @property
    def shown_default(self) -> str:
        if self.shown:
            return self.shown
        return "unset" if self.default is None else f"`{self.default}`"

    def get(self, environ: Mapping[str, str] | None = None) -> T:
        """The value now (``environ``: os.environ unless given)."""
        environ = os.environ if environ is None else environ
        raw = environ.get(self.name)
        if raw is None and self.fallback:
            raw = environ.get(self.fallback)
        if raw is None or (raw == "" and self.blank_is_unset):
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise BadVariable(f"{self.name}: {exc}") from None


# --- the types ---------------------------------------------------------------------

_MESH_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,30}")


def check_mesh_id(value: str) -> str:
    """A mesh id: the prefix of every shared block the mesh owns, so a safe file name."""
    if not _MESH_ID.fullmatch(value):
        raise ValueError(
            f"mesh id {value!r}: expected 1-31 of a-z, 0-9 and '-', not starting with '-'"
        )
    return value


def _text(value: str) -> str:
    return value


def _path(value: str) -> Path:
    return Path(value)


def _number(
    convert: Callable[[str], N], ok: Callable[[N], bool], expected: str
) -> Callable[[str], N]:
    def parse(value: str) -> N:
        try:
            number: N | None = convert(value)
        except ValueError:
            number = None
        if number is None or not ok(number):
            raise ValueError(f"expected {expected}, got {value!r}")
        return number

    return parse


_port = _number(int, lambda port: 0 < port < 65536, "a port 1-65535")
_pid = _number(int, lambda pid: pid > 0, "a process id")
_seconds = _number(float, lambda seconds: seconds > 0, "a number of seconds > 0")


def _log_level(value: str) -> str:
    level = value.upper()
    if level not in logging.getLevelNamesMapping():
        raise ValueError(f"expected a level (DEBUG, INFO, WARNING, ERROR), got {value!r}")
    return level


def _file(name: str, read_by: str, meaning: str, shown: str = "") -> Variable[Path | None]:
    return Variable(name, _path, None, read_by, meaning, blank_is_unset=True, shown=shown)


# --- every process -----------------------------------------------------------------

SERVERS = "stage, orchestrator"

LOG_LEVEL = Variable("OMNI_LOG_LEVEL", _log_level, "INFO", SERVERS, "the log level (stderr)")
PARENT_PID = Variable[int | None](
    "OMNI_PARENT_PID",
    _pid,
    None,
    "stage",
    "the launcher's pid (`omni up` sets it): the stage stops when that process dies",
    blank_is_unset=True,
)
MESH_ID = Variable(
    "OMNI_MESH_ID",
    check_mesh_id,
    "default",
    SERVERS,
    "this mesh instance's id: the prefix of its shared-memory blocks (`omni up` sets one)",
)
NODE_NAME = Variable(
    "OMNI_NODE_NAME",
    _text,
    "",
    SERVERS,
    "the Kubernetes node this process runs on: who can open whose tensor refs",
    fallback="NODE_NAME",
    shown="`$NODE_NAME`, else empty",
)
ADVERTISE_HOST = Variable(
    "OMNI_ADVERTISE_HOST",
    _text,
    "",
    "stage",
    "the address other stages pull this stage's tensors from (the chart sets the Pod's IP)",
    shown="the bind host, or this host name's address when it binds every address",
)
PROMETHEUS_PORT = Variable[int | None](
    "OMNI_PROMETHEUS_PORT",
    _port,
    None,
    SERVERS,
    "serve metrics for scraping on this port (`/metrics`)",
    shown="unset: not served",
)
PROMETHEUS_HOST = Variable(
    "OMNI_PROMETHEUS_HOST",
    _text,
    "127.0.0.1",
    SERVERS,
    "the address the metrics port listens on",
)

# --- security: a file's ``security:`` section, then these, then the flags ------------

TLS_CERT = _file(
    "OMNI_TLS_CERT", SERVERS, "security `tls_cert`: this server's TLS certificate (PEM)"
)
TLS_KEY = _file("OMNI_TLS_KEY", SERVERS, "security `tls_key`: its private key (PEM)")
TLS_CA = _file("OMNI_TLS_CA", SERVERS, "security `tls_ca`: the mesh CA")
TLS_CLIENT_CERT = _file(
    "OMNI_TLS_CLIENT_CERT",
    "orchestrator",
    "security `client_cert`: presented to the stages",
    shown="its `tls_cert`",
)
TLS_CLIENT_KEY = _file(
    "OMNI_TLS_CLIENT_KEY",
    "orchestrator",
    "security `client_key`: its private key",
    shown="its `tls_key`",
)
MESH_TOKEN_FILE = _file(
    "OMNI_MESH_TOKEN_FILE",
    SERVERS,
    "security `mesh_token_file`: stages accept the mesh token, the orchestrator sends it",
)
TOKENS_FILE = _file(
    "OMNI_TOKENS_FILE",
    "orchestrator",
    "security `tokens_file`: client bearer tokens (YAML) at the front door",
)
MAX_PAUSE_S = Variable[float | None](
    "OMNI_MAX_PAUSE_S",
    _seconds,
    None,
    "orchestrator",
    "security `max_pause_s`: the longest `PauseGeneration` holds new requests",
    blank_is_unset=True,
    shown="the file's, else 300",
)
KUBE_SERVICEACCOUNT_DIR = Variable(
    "OMNI_KUBE_SERVICEACCOUNT_DIR",
    _path,
    Path("/var/run/secrets/kubernetes.io/serviceaccount"),
    "orchestrator",
    "where the Pod's service account (token, ca.crt, namespace) is read from to watch "
    "the stages' Pods (the tests' own API server's account)",
    blank_is_unset=True,
    shown="`/var/run/secrets/kubernetes.io/serviceaccount`",
)

# --- the stage ---------------------------------------------------------------------

CACHE_DIR = Variable(
    "OMNI_CACHE_DIR",
    _path,
    Path("~/.cache/omni-mesh"),
    "stage",
    "where models are fetched to, when the stage file names no `cache_dir`",
    blank_is_unset=True,
)
# Per user: a lock dir shared by all users would let one plant links in another's way.
LOCK_DIR = Variable(
    "OMNI_LOCK_DIR",
    _path,
    Path(f"/tmp/omni-locks-{os.getuid()}"),
    "stage",
    "where the device lock files live, when the stage file names no `lock_dir`",
    blank_is_unset=True,
    shown="`/tmp/omni-locks-<uid>`",
)

KERNEL_VARIANTS = ("reference", "avx2", "avx512", "avx512vnni")


def _kernel_variant(value: str) -> str:
    if value not in KERNEL_VARIANTS:
        raise ValueError(f"expected one of {', '.join(KERNEL_VARIANTS)}, got {value!r}")
    return value


KERNELS = Variable[str | None](
    "OMNI_KERNELS",
    _kernel_variant,
    None,
    "stage",
    "the CPU kernel variant to run (`reference`, `avx2`, `avx512`, `avx512vnni`) instead of "
    "the best this CPU runs; one it cannot run is refused, naming what it lacks",
    blank_is_unset=True,
    shown="the best this CPU runs",
)

KERNELS_LIBRARY = _file(
    "OMNI_KERNELS_LIBRARY",
    "stage",
    "a kernels library built elsewhere to load instead of the installed one (the tests "
    "load a reference-only build this way)",
    shown="the installed `services/kernels/_ops.so`",
)

# --- clients of the orchestrator: `omni generate`, `omni gateway` --------------------

ADDRESS = Variable[str | None](
    "OMNI_ADDRESS",
    _text,
    None,
    "omni generate, omni gateway",
    "the orchestrator to ask (`--address`; the gateway's `--orchestrator`)",
    shown="`127.0.0.1:50050`",
)
TOKEN = Variable[str | None](
    "OMNI_TOKEN", _text, None, "omni generate", "the bearer token (`--token`)", blank_is_unset=True
)
TOKEN_FILE = _file(
    "OMNI_TOKEN_FILE",
    "omni generate",
    "a file holding the bearer token, when there is no `--token`",
)
CACERT = _file(
    "OMNI_CACERT",
    "omni generate, omni gateway",
    "speak TLS, verifying the orchestrator with this CA (`--cacert`)",
)

VARIABLES: tuple[Variable[Any], ...] = (
    LOG_LEVEL,
    PARENT_PID,
    MESH_ID,
    NODE_NAME,
    ADVERTISE_HOST,
    PROMETHEUS_PORT,
    PROMETHEUS_HOST,
    TLS_CERT,
    TLS_KEY,
    TLS_CA,
    TLS_CLIENT_CERT,
    TLS_CLIENT_KEY,
    MESH_TOKEN_FILE,
    TOKENS_FILE,
    MAX_PAUSE_S,
    KUBE_SERVICEACCOUNT_DIR,
    CACHE_DIR,
    LOCK_DIR,
    KERNELS,
    KERNELS_LIBRARY,
    ADDRESS,
    TOKEN,
    TOKEN_FILE,
    CACERT,
)
