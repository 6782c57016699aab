"""Which replicas a stage's address names, one ``host:port`` each.

- ``ipv4:a:p,b:p`` / ``ipv6:[a]:p,[b]:p``: the list, as written (fixed).
- ``dns:[//authority/]name:port``: every address the name resolves to, looked up
  again every ``resolve_s`` (a headless Service's Pods come and go).
- anything else (``host:port``): one replica, dialled as written (``localhost``
  may resolve to two addresses of one process).

The lookup is the system's resolver; tests hand in their own (``Lookup``).
A replica of a ``dns:`` name is dialled by its address, TLS still verifying the
name (``pinned_dialing``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from services.mesh.security import Dialing

# (host, port) -> the addresses it resolves to now
Lookup = Callable[[str, int], Awaitable[list[str]]]


async def system_lookup(host: str, port: int) -> list[str]:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return f"{host}:{port}"
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


@dataclass(frozen=True)
class Target:
    """A stage's address, parsed: ``fixed`` replicas, or a ``dns`` name to look up."""

    address: str
    fixed: tuple[str, ...] = ()
    host: str = ""  # the name a dns: target looks up (and TLS verifies)
    port: int = 0

    @property
    def dns(self) -> bool:
        return bool(self.host)

    @classmethod
    def parse(cls, address: str) -> Target:
        scheme, _, rest = address.partition(":")
        if scheme in ("ipv4", "ipv6"):
            listed = tuple(a.strip() for a in rest.split(",") if a.strip())
            if not listed:
                raise ValueError(f"{address!r}: an {scheme}: target lists no address")
            return cls(address, fixed=listed)
        if scheme == "dns":
            if rest.startswith("//"):  # an authority (a DNS server), then the name
                rest = rest[2:].partition("/")[2]
            name, _, port = rest.rpartition(":")
            if not name or not port.isdigit():
                raise ValueError(f"{address!r}: expected dns:name:port")
            return cls(address, host=name.strip("[]"), port=int(port))
        return cls(address, fixed=(address,))

    async def resolve(self, lookup: Lookup = system_lookup) -> list[str]:
        """The replicas' addresses now, each once, in the order found."""
        if not self.dns:
            return list(self.fixed)
        found = await lookup(self.host, self.port)
        return list(dict.fromkeys(host_port(ip, self.port) for ip in found))


def pinned_dialing(dialing: Dialing, host: str) -> Dialing:
    """Dialing a replica of a ``dns:`` name by its address, TLS still verifies the name."""
    if dialing.credentials is None:
        return dialing
    return _Pinned(dialing.credentials, dialing.token, authority=host)


@dataclass(frozen=True)
class _Pinned(Dialing):
    authority: str = ""

    def channel(self, address: str, options: list[tuple[str, Any]]) -> grpc.aio.Channel:
        pinned = [
            *options,
            ("grpc.ssl_target_name_override", self.authority),
            ("grpc.default_authority", self.authority),
        ]
        return super().channel(address, pinned)
