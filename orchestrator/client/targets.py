"""Where a client of the orchestrator dials, and how a call finds another
orchestrator when one is gone.

An address is one ``host:port``, any gRPC target (``dns:NAME:PORT``: every
address the name has, looked up again when a connection fails;
``ipv4:a:p,b:p``), or several ``host:port`` joined by commas (or given as a list),
each an IP address (made an ``ipv4:``/``ipv6:`` target). The channel has a
connection to each orchestrator and deals calls in turn (round_robin); a call
that fails UNAVAILABLE before the orchestrator answered anything (it had not
started: a connection refused or reset, an orchestrator killed before its first
event) is tried again on another, up to ``ATTEMPTS`` times in all. A call that has
had an answer is never tried again: a request an orchestrator carried fails with
it (UNAVAILABLE), as its client was told.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Sequence

from services.mesh.rpc.stage_client import channel_options

ATTEMPTS = 3
SERVICE = "omni.v1.Orchestrator"
_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:")


def target(address: str | Sequence[str]) -> str:
    """``address`` as one gRPC target; ValueError naming an address that cannot join a list."""
    listed = [address] if isinstance(address, str) else list(address)
    if len(listed) == 1 and (listed[0].startswith(_SCHEMES) or "," not in listed[0]):
        return listed[0].strip()
    parts = [p.strip() for item in listed for p in item.split(",") if p.strip()]
    if not parts:
        raise ValueError("expected an orchestrator address, got none")
    if len(parts) == 1:
        return parts[0]
    versions = {_ip_version(part) for part in parts}
    if len(versions) != 1:
        raise ValueError(f"{','.join(parts)!r}: expected IPv4 addresses only or IPv6 only")
    return f"ipv{versions.pop()}:{','.join(parts)}"


def _ip_version(address: str) -> int:
    host, _, port = address.rpartition(":")
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        raise ValueError(
            f"{address!r}: several orchestrators are given as IP:PORT each, "
            "or as one name with several addresses (dns:NAME:PORT)"
        ) from None
    if not port.isdigit():
        raise ValueError(f"{address!r}: expected IP:PORT")
    return ip.version


def service_config() -> str:
    retry = {
        "maxAttempts": ATTEMPTS,
        "initialBackoff": "0.1s",
        "maxBackoff": "1s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    return json.dumps(
        {
            "loadBalancingConfig": [{"round_robin": {}}],
            "methodConfig": [{"name": [{"service": SERVICE}], "retryPolicy": retry}],
        }
    )


def client_options() -> list[tuple[str, int | str]]:
    """A client's channel options: ours (keepalive, no size limit), with retries."""
    options = [(k, v) for k, v in channel_options() if k != "grpc.service_config"]
    return [*options, ("grpc.service_config", service_config()), ("grpc.enable_retries", 1)]


CLIENT_OPTIONS = client_options()
