"""Bearer tokens: who a token names (a ``Principal``), the tokens file of the
orchestrator's clients (YAML ``tokens: [{name, token, admin}]``), a token kept in
a mounted secret file, and the ``authorization: Bearer`` metadata that carries one."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, model_validator

from services.mesh import config_files
from services.mesh.config_files import ConfigError, Frozen
from services.mesh.security.settings import MIN_TOKEN_CHARS


@dataclass(frozen=True)
class Principal:
    """Who is calling: a token's name, the mesh, or the anonymous caller (auth off)."""

    name: str
    admin: bool = False
    mesh: bool = False


# With authentication off every caller is this one principal, allowed everything.
ANONYMOUS = Principal("anonymous", admin=True, mesh=True)


def read_file(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the {what} ({exc.strerror})") from None


def read_secret(path: Path) -> str:
    """A token kept in a file (a mounted secret): its text, whitespace stripped."""
    try:
        token = read_file(path, "token file").decode().strip()
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: expected a UTF-8 token") from None
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(f"{path}: expected a token of at least {MIN_TOKEN_CHARS} characters")
    return token


class _TokenEntry(Frozen):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.@-]*$")
    token: str = Field(min_length=MIN_TOKEN_CHARS)
    admin: bool = False


class _TokensFile(Frozen):
    tokens: tuple[_TokenEntry, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> _TokensFile:
        names = [t.name for t in self.tokens]
        if len(set(names)) != len(names):
            raise ValueError("tokens: expected each name once")
        if len({t.token for t in self.tokens}) != len(self.tokens):
            raise ValueError("tokens: expected each token once")
        return self


def tokens_file_with(base: Path | None, name: str, token: str, *, admin: bool) -> str:
    """The text of a tokens file: ``base``'s tokens (none if None) and one more;
    ConfigError naming ``base`` if it does not parse or already has ``name``."""
    entries = list(config_files.load(_TokensFile, base).tokens) if base is not None else []
    if any(entry.name == name for entry in entries):
        raise ConfigError(f"{base}: tokens: the name {name!r} is reserved for omni up's own token")
    entries.append(_TokenEntry(name=name, token=token, admin=admin))
    return yaml.safe_dump({"tokens": [entry.model_dump() for entry in entries]})


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class Tokens:
    """Bearer tokens and whom each one names; looked up by digest, compared in constant time."""

    def __init__(self, principals: Mapping[str, Principal]) -> None:
        self._by_digest = {_digest(t): p for t, p in principals.items()}

    def __bool__(self) -> bool:
        return bool(self._by_digest)

    @classmethod
    def load(cls, path: Path) -> Tokens:
        parsed = config_files.load(_TokensFile, path)
        return cls({t.token: Principal(t.name, admin=t.admin) for t in parsed.tokens})

    def principal(self, token: str) -> Principal | None:
        digest = _digest(token)
        for known, principal in self._by_digest.items():
            if hmac.compare_digest(known, digest):
                return principal
        return None


def bearer(metadata: Collection[tuple[str, Any]] | None) -> str:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer":
                return token.strip()
    return ""


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()
