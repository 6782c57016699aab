"""Our servers as child processes: started, their port learnt from the
``listening HOST:PORT`` line they print, stopped cleanly (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from services.mesh import environment

logger = logging.getLogger(__name__)


class ServiceExited(RuntimeError):
    """The server exited before binding; ``code`` is its exit status (a stage: 1 a
    taken port, 2 a bad stage file)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class ServiceProcess(abc.ABC):
    """A server child process (port 0 picks a free one; a restart reuses the port)."""

    def __init__(
        self,
        config: Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        log: IO[bytes] | None = None,
        env: dict[str, str] | None = None,
    ):
        self.config = config
        self.host = host
        self.port = port
        self._log = log
        self._env = env or {}
        self._proc: asyncio.subprocess.Process | None = None
        self.address = ""

    @property
    def pid(self) -> int:
        return self._proc.pid if self._proc else 0

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode if self._proc else None

    @abc.abstractmethod
    def command(self) -> list[str]:
        """The argv that starts the server (host and port are appended)."""

    async def start(self, timeout_s: float = 60.0) -> str:
        """Spawn the server and return its address once it has bound its port."""
        cmd = [*self.command(), "--host", self.host, "--port", str(self.port)]
        log_from = self._log.seek(0, os.SEEK_END) if self._log is not None else 0
        self._proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdout=asyncio.subprocess.PIPE,
            stderr=self._log if self._log is not None else None,
            # The child stops when we die, even by SIGKILL (services.mesh.process).
            env={
                **os.environ,
                "PYTHONUNBUFFERED": "1",
                environment.PARENT_PID.name: str(os.getpid()),
                **self._env,
            },
        )
        assert self._proc.stdout is not None
        try:
            line = await asyncio.wait_for(self._proc.stdout.readline(), timeout_s)
        except TimeoutError:
            await self.stop(0)
            raise RuntimeError(
                f"{self.config}: the server did not bind within {timeout_s:.0f}s"
            ) from None
        text = line.decode().strip()
        if not text.startswith("listening "):
            code = await self._proc.wait()
            said = self._said_since(log_from)
            raise ServiceExited(
                f"{self.config}: the server exited with {code} before binding"
                + (f": {said}" if said else ""),
                code,
            )
        self.address = text.removeprefix("listening ")
        self.port = int(self.address.rsplit(":", 1)[1])
        return self.address

    def _said_since(self, offset: int, lines: int = 5) -> str:
        """The last lines the child wrote to its log (its own error message)."""
        name = getattr(self._log, "name", None)
        if not isinstance(name, str):
            return ""
        try:
            with open(name, "rb") as log:
                log.seek(offset)
                text = log.read(64 << 10).decode(errors="replace")
        except OSError:
            return ""
        kept = [line for line in text.splitlines() if line.strip()][-lines:]
        return "\n".join(kept)

    async def wait(self) -> int:
        assert self._proc is not None, "start() first"
        return await self._proc.wait()

    async def kill(self) -> int:
        """SIGKILL: gone at once, nothing drained (a crash, an OOM kill)."""
        assert self._proc is not None, "start() first"
        if self._proc.returncode is None:
            self._proc.kill()
        return await self._proc.wait()

    async def stop(self, grace_s: float = 10.0) -> int:
        """SIGTERM, wait up to grace (+ margin), then SIGKILL. Returns the exit code."""
        proc = self._proc
        if proc is None:
            return 0
        if proc.returncode is not None:
            return proc.returncode
        proc.send_signal(signal.SIGTERM)
        try:
            return await asyncio.wait_for(proc.wait(), grace_s + 5.0)
        except TimeoutError:
            logger.warning("%s ignored SIGTERM; killing pid %d", self.config, proc.pid)
            proc.kill()
            return await proc.wait()


class StageProcess(ServiceProcess):
    """``python -m services.stage serve --config FILE``: one stage service, run by
    ``python`` (another venv's, for an engine this one lacks) or by this Python."""

    def __init__(self, config: Path, *, python: Path | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.python = python

    def command(self) -> list[str]:
        python = str(self.python) if self.python is not None else sys.executable
        return [python, "-m", "services.stage", "serve", "--config", str(self.config)]


class OrchestratorProcess(ServiceProcess):
    """``omni orchestrator serve --pipeline FILE``: the orchestrator on its own
    (``args``: more of its flags, e.g. ``--peers``)."""

    def __init__(self, config: Path, *, args: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.args = tuple(args)

    def command(self) -> list[str]:
        cli = [sys.executable, "-m", "orchestrator.cli.main", "orchestrator", "serve"]
        return [*cli, "--pipeline", str(self.config), *self.args]


class GatewayProcess(ServiceProcess):
    """``python -m services.gateway`` (``omni gateway``): the HTTP front door to
    the orchestrator at ``orchestrator`` (TLS verified with ``cacert`` when given)."""

    def __init__(
        self,
        orchestrator: str,
        *,
        cacert: Path | None = None,
        args: Sequence[str] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(Path("omni gateway"), **kwargs)
        self.orchestrator = orchestrator
        self.cacert = cacert
        self.args = tuple(args)  # more of its flags (--max-connections, --backlog)

    def command(self) -> list[str]:
        cli = [sys.executable, "-m", "services.gateway", "--orchestrator", self.orchestrator]
        cli += ["--cacert", str(self.cacert)] if self.cacert else []
        return [*cli, *self.args]

    def again(self) -> GatewayProcess:
        """A new process like this one, on the port this one had."""
        return GatewayProcess(
            self.orchestrator,
            cacert=self.cacert,
            args=self.args,
            host=self.host,
            port=self.port,
            log=self._log,
            env=self._env,
        )


class Kept:
    """A gateway kept running: restarted on its port whenever it exits (backoff
    from ``initial_s`` doubling to ``max_s``; back to ``initial_s`` after a run of
    ``healthy_after_s``), as the launcher keeps its stages, until ``stop()``.
    ``log``: the file its processes write to, owned (closed) here."""

    def __init__(
        self,
        process: GatewayProcess,
        log: IO[bytes] | None = None,
        *,
        initial_s: float = 1.0,
        max_s: float = 30.0,
        healthy_after_s: float = 60.0,
    ) -> None:
        self.process = process
        self._log = log  # the processes' log: closed by stop()
        self.restarts = 0
        self._initial_s, self._max_s, self._healthy_after_s = initial_s, max_s, healthy_after_s
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> str:
        """Start it (an error if the first start fails), then watch it."""
        address = await self.process.start()
        self._task = asyncio.create_task(self._supervise(), name="keep-gateway")
        return address

    async def _supervise(self) -> None:
        delay = self._initial_s
        while True:
            began = time.monotonic()
            code = await self.process.wait()
            if time.monotonic() - began >= self._healthy_after_s:
                delay = self._initial_s
            self.restarts += 1
            logger.warning(
                "the gateway exited with code %s; restarting in %.1fs (restart %d)",
                code,
                delay,
                self.restarts,
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._max_s)
            self.process = self.process.again()
            try:
                await self.process.start()
            except (RuntimeError, OSError) as exc:  # its port not free yet: the next try waits
                logger.warning("the gateway did not restart: %s", exc)

    async def stop(self, grace_s: float = 10.0) -> int:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        try:
            return await self.process.stop(grace_s)
        finally:
            if self._log is not None:
                self._log.close()
