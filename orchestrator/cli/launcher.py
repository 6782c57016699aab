"""`omni up`: every launched stage as its own process on its own port, plus the
orchestrator, on one machine.

The launcher owns the stage processes: it restarts one that crashes (with
backoff, on the same port, so the orchestrator's channel reconnects to it) and
stops all of them on the way out, then removes the mesh's shared-memory blocks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from orchestrator.cli.processes import StageProcess
from orchestrator.server.pipeline import PipelineConfig
from orchestrator.server.server import OrchestratorServer
from services.mesh import environment
from services.mesh.security import SecuritySettings

logger = logging.getLogger(__name__)


@dataclass
class _Launched:
    name: str
    process: StageProcess
    log: IO[bytes]
    restarts: int = 0
    delays: list[float] = field(default_factory=list)  # waited before each restart
    supervisor: asyncio.Task[None] | None = field(default=None, repr=False)


class Launcher:
    def __init__(
        self,
        pipeline: PipelineConfig,
        *,
        run_dir: Path,
        mesh_id: str,
        host: str = "127.0.0.1",
        port: int = 50050,
        restart_initial_s: float = 1.0,
        restart_max_s: float = 30.0,
        healthy_after_s: float = 60.0,
        security: SecuritySettings | None = None,
        stage_env: Mapping[str, Mapping[str, str]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pipeline = pipeline
        self.run_dir = run_dir
        self.mesh_id = mesh_id
        self.host = host
        self.port = port
        self._restart_initial_s = restart_initial_s
        self._restart_max_s = restart_max_s
        # A stage that ran this long before exiting was healthy: its next
        # restart waits restart_initial_s again, not the backoff so far.
        self._healthy_after_s = healthy_after_s
        self._clock = clock
        self._security = security
        self._stage_env = {name: dict(env) for name, env in (stage_env or {}).items()}
        self._stages: dict[str, _Launched] = {}
        self._stopping = False
        self.server: OrchestratorServer | None = None

    @property
    def processes(self) -> dict[str, StageProcess]:
        return {name: launched.process for name, launched in self._stages.items()}

    async def start(self) -> OrchestratorServer:
        """Start the stages, then the orchestrator over them; returns it (not yet ready)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _sweep(self.mesh_id)
        for stage in self.pipeline.stages:
            if stage.launch is None:
                continue
            log = self._open_log(stage.name)
            process = StageProcess(
                stage.launch,
                python=stage.python,
                host=self.host,
                log=log,
                env=self._env(stage.name),
            )
            self._stages[stage.name] = _Launched(stage.name, process, log)
        # Concurrently: each process spends seconds importing torch before it binds.
        bound = await asyncio.gather(*(s.process.start() for s in self._stages.values()))
        addresses = dict(zip(self._stages, bound, strict=True))
        for name, launched in self._stages.items():
            logger.info("stage %s: pid %d on %s", name, launched.process.pid, addresses[name])
        pipeline = self.pipeline.with_addresses(addresses)
        self.server = OrchestratorServer(pipeline, mesh=self.mesh_id, security=self._security)
        self.port = await self.server.start(self.host, self.port)
        for launched in self._stages.values():
            launched.supervisor = asyncio.create_task(self._supervise(launched))
        return self.server

    def _env(self, stage: str) -> dict[str, str]:
        return {environment.MESH_ID.name: self.mesh_id, **self._stage_env.get(stage, {})}

    def _open_log(self, name: str) -> IO[bytes]:
        # Closed by stop(); appending keeps the output of earlier runs and restarts.
        return (self.run_dir / f"{name}.log").open("ab")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def _supervise(self, launched: _Launched) -> None:
        delay = self._restart_initial_s
        while True:
            began = self._clock()
            code = await launched.process.wait()
            if self._stopping:
                return
            if self.server is not None:  # DOWN for routing now, not at a health poll
                self.server.stage_exited(launched.name, code)
            if self._clock() - began >= self._healthy_after_s:
                delay = self._restart_initial_s
            launched.restarts += 1
            launched.delays.append(delay)
            logger.warning(
                "stage %s exited with code %s; restarting in %.1fs (restart %d)",
                launched.name,
                code,
                delay,
                launched.restarts,
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._restart_max_s)
            old = launched.process
            launched.process = StageProcess(
                old.config,
                python=old.python,
                host=self.host,
                port=old.port,
                log=launched.log,
                env=self._env(launched.name),
            )
            try:
                await launched.process.start()
            except RuntimeError as exc:  # e.g. the port is not free yet: try again later
                logger.warning("stage %s did not restart: %s", launched.name, exc)

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop the orchestrator and every stage (SIGTERM, then SIGKILL after the
        grace period); remove the mesh's shared-memory blocks. Safe to call twice."""
        self._stopping = True
        for launched in self._stages.values():
            if launched.supervisor is not None:
                launched.supervisor.cancel()
        if self.server is not None:
            await self.server.stop(1.0)
            self.server = None
        await asyncio.gather(*(s.process.stop(grace_s) for s in self._stages.values()))
        for launched in self._stages.values():
            launched.log.close()
        _sweep(self.mesh_id)


def _sweep(mesh_id: str) -> None:
    """Remove shared-memory blocks left by dead processes of this mesh."""
    try:
        from services.mesh.data.shm_dir import sweep
    except ImportError:  # the data plane is optional for a mesh that moves bytes only
        return
    removed = sweep(mesh_id)
    if removed:
        logger.info("removed %d shared-memory block(s) left by dead processes", len(removed))


def default_mesh_id() -> str:
    return f"up{os.getpid()}"
