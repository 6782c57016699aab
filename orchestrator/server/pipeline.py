"""The pipeline file (YAML): which stages make up a mesh and how requests flow
between them, validated once into frozen models.

Every error names the file, the key path inside it and what was expected
(services.mesh.config_files), e.g. ``pipe.yaml: edges.1.to: unknown stage; expected
one of thinker, renderer (got 'rendrer')``. The models check the graph; ``parse_pipeline``
also checks that launch files exist and resolves their paths. An edge's transform is
checked against the consuming stage's Describe once it is up.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError, ValidationError

from orchestrator.server.front_door import OrchestratorRuntime
from orchestrator.server.pipeline_graph import Loc, names_and_edges, shape
from services.mesh import config_files
from services.mesh.config_files import ConfigError, Frozen
from services.mesh.security import SecuritySettings

# An edge's transform is a name the consuming stage offers (its Describe lists
# them and what each needs); "" passes inputs through unchanged.
TRANSFORM_PATTERN = r"^([a-z][a-z0-9_]*)?$"
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"


def _invalid(problems: list[tuple[Loc, str, Any]], title: str) -> ValidationError:
    """A ValidationError at exact paths: pydantic prefixes nested locations, so a
    cross-field problem points at the key to fix, not at the whole mapping."""
    return ValidationError.from_exception_data(
        title,
        [
            InitErrorDetails(
                type=PydanticCustomError("pipeline", "{message}", {"message": message}),
                loc=loc,
                input=got,
            )
            for loc, message, got in problems
        ],
    )


def check_address(address: str) -> str:
    """``host:port`` (IPv6 hosts in brackets) with a port in 1-65535."""
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    ok = bool(sep and host and port.isdigit()) and 1 <= int(port) <= 65535
    if not ok or any(c.isspace() for c in host):
        raise ValueError("expected host:port with a port in 1-65535")
    return address


class Stage(Frozen):
    name: str = Field(pattern=NAME_PATTERN)
    # A launched stage may leave its address out: `omni up` fills it in at runtime
    # (PipelineConfig.with_addresses) once the process says where it listens.
    address: str | None = None
    launch: Path | None = None
    # The Python that runs a launched stage (a venv with that stage's engine, e.g.
    # .venv-vllm/bin/python); default: the one running `omni up`.
    python: Path | None = None
    init_timeout_s: float = Field(600.0, gt=0)
    download_stall_timeout_s: float = Field(60.0, gt=0)
    # Which replica a new request goes to when the address names several
    # (stages/replicas.py): the least busy ready one, or each in turn.
    routing: Literal["least_outstanding", "round_robin"] = "least_outstanding"
    # The requests of one conversation (GenerateRequest.affinity_key) go to the
    # replica that had its last one while that one is ready: its prefix cache.
    affinity: bool = False
    # In Kubernetes: a label selector of the stage's Pods, watched through the API in
    # the orchestrator's namespace (stages/kube_source.py); the address gives their
    # port, and its dns: name is used instead where the API cannot be asked.
    pods: str = ""
    # A stage on no edge, reached only by requests addressed to it alone
    # (GenerateRequest.stage): a recogniser that turns each clip into text once, at
    # the edge of the conversation, rather than in every request's path.
    alone: bool = False

    @field_validator("address")
    @classmethod
    def _host_port(cls, address: str | None) -> str | None:
        return None if address is None else check_address(address)

    def require_address(self) -> str:
        """Where to dial the stage; a launched stage has one only after with_addresses."""
        if self.address is None:
            raise ValueError(
                f"stage {self.name!r} has no address yet: it is launched from {self.launch} "
                "and its address is set once it listens (PipelineConfig.with_addresses)"
            )
        return self.address

    @model_validator(mode="after")
    def _reachable(self) -> Stage:
        if self.address is None and self.launch is None:
            raise _invalid(
                [(("address",), "expected host:port, or a launch file to start the stage", None)],
                "Stage",
            )
        return self


class Edge(Frozen):
    model_config = ConfigDict(populate_by_name=True)

    from_: str = Field(alias="from")
    to: str
    # -1: the downstream stage starts after the upstream is_last (full trigger);
    # N: every N items are forwarded as soon as they are complete.
    window: int = -1
    # The first window's size when smaller than ``window`` (a quicker first output).
    first_window: int | None = Field(None, ge=1)
    transform: str = Field("", pattern=TRANSFORM_PATTERN)
    high_watermark: int = Field(64, ge=1)
    low_watermark: int = Field(16, ge=0)

    @field_validator("window")
    @classmethod
    def _window(cls, window: int) -> int:
        if window != -1 and window < 1:
            raise ValueError("expected -1 (full trigger) or a window of at least 1 item")
        return window

    @field_validator("transform", mode="before")
    @classmethod
    def _blank_transform(cls, transform: Any) -> Any:
        return "" if transform is None else transform  # `transform:` with no value

    @model_validator(mode="after")
    def _first_window(self) -> Edge:
        if self.first_window is not None and self.window == -1:
            message = "expected a window of N items to start smaller than (window is -1)"
            raise _invalid([(("first_window",), message, self.first_window)], "Edge")
        return self

    @model_validator(mode="after")
    def _watermarks(self) -> Edge:
        if self.low_watermark >= self.high_watermark:
            message = f"expected less than high_watermark ({self.high_watermark})"
            raise _invalid([(("low_watermark",), message, self.low_watermark)], "Edge")
        return self


class Watchdog(Frozen):
    # The device-lock wait is never paused (docs/design.md, 'The init watchdog'), so it
    # is not a choice here.
    paused_phases: frozenset[Literal["download", "load"]] = frozenset({"download"})


class PipelineConfig(Frozen):
    name: str = Field(pattern=NAME_PATTERN)
    stages: tuple[Stage, ...] = Field(min_length=1)
    edges: tuple[Edge, ...] = ()
    # Named apart from the `outputs` property, which resolves the default (leaves).
    output_stages: tuple[str, ...] | None = Field(None, alias="outputs", min_length=1)
    watchdog: Watchdog = Watchdog()
    # TLS, tokens and the pause limit (services.mesh.security); OMNI_* env and
    # flags of `omni orchestrator serve` override it.
    security: SecuritySettings = SecuritySettings()
    # What clients may hold: message sizes, input budgets, connections (front_door.py).
    runtime: OrchestratorRuntime = OrchestratorRuntime()

    @model_validator(mode="after")
    def _graph(self) -> PipelineConfig:
        # Later checks assume earlier ones hold (known names before cycles), so
        # each group reports all it finds and stops the rest.
        for check in (names_and_edges, shape):
            problems = check(self)
            if problems:
                raise _invalid(problems, "PipelineConfig")
        return self

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.stages)

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"unknown stage {name!r} (stages: {', '.join(self.names)})")

    def children(self, name: str) -> tuple[Edge, ...]:
        self.stage(name)
        return tuple(e for e in self.edges if e.from_ == name)

    def incoming(self, name: str) -> Edge | None:
        self.stage(name)
        return next((e for e in self.edges if e.to == name), None)

    @property
    def entry(self) -> str:
        """The one stage (not alone) no edge leads to: every request starts there."""
        targets = {e.to for e in self.edges}
        return next(s.name for s in self.stages if s.name not in targets and not s.alone)

    @property
    def listed(self) -> tuple[str, ...]:
        """Every stage as ListStages lists them: the entry first, then as requests
        reach them, then the stages alone."""
        return (*self.order, *(s.name for s in self.stages if s.alone))

    @property
    def order(self) -> tuple[str, ...]:
        """Stages in topological order (breadth first from the entry, edges in file order)."""
        order = [self.entry]
        for name in order:  # grows while iterating: a queue without the bookkeeping
            order.extend(e.to for e in self.children(name))
        return tuple(order)

    @property
    def leaves(self) -> tuple[str, ...]:
        sources = {e.from_ for e in self.edges}
        return tuple(n for n in self.order if n not in sources)

    @property
    def outputs(self) -> tuple[str, ...]:
        """Stages whose events reach the client: as listed, else the leaves."""
        return self.output_stages if self.output_stages is not None else self.leaves

    def with_addresses(self, addresses: Mapping[str, str]) -> PipelineConfig:
        """A copy with the given stages' addresses set (launched stages, once listening)."""
        for name, address in addresses.items():
            self.stage(name)
            try:
                check_address(address)
            except ValueError as exc:
                raise ValueError(f"stage {name!r}: {exc} (got {address!r})") from None
        stages = tuple(
            s.model_copy(update={"address": addresses[s.name]}) if s.name in addresses else s
            for s in self.stages
        )
        return self.model_copy(update={"stages": stages})


def parse_pipeline(
    data: Any,
    source: str = "<pipeline>",
    *,
    base_dir: Path | None = None,
) -> PipelineConfig:
    """Validate a parsed pipeline file; launch paths resolve against ``base_dir``
    (default: the working directory) and must name existing files."""
    config = config_files.validate(PipelineConfig, data, source)
    base = (base_dir or Path.cwd()).resolve()
    problems: list[str] = []
    stages: list[Stage] = []
    for i, stage in enumerate(config.stages):
        if stage.launch is not None:
            path = (base / stage.launch.expanduser()).resolve()
            if not path.is_file():
                problems.append(
                    f"stages.{i}.launch: expected a stage file, found none at {path} "
                    f"(got {str(stage.launch)!r})"
                )
            stage = stage.model_copy(update={"launch": path})
        if stage.python is not None:
            # Not resolved: a venv's bin/python is a link whose own path selects the venv.
            python = base / stage.python.expanduser()
            if not os.access(python, os.X_OK):
                problems.append(
                    f"stages.{i}.python: expected an executable Python, found none at {python} "
                    f"(got {str(stage.python)!r})"
                )
            stage = stage.model_copy(update={"python": python})
        stages.append(stage)
    if problems:
        raise ConfigError("\n".join(f"{source}: {p}" for p in problems))
    return config.model_copy(update={"stages": tuple(stages)})


def load_pipeline(path: str | Path) -> PipelineConfig:
    path = Path(path)
    data = config_files.read_yaml(path)
    return parse_pipeline(data, str(path), base_dir=path.parent)
