"""The pipeline file's graph checks: names and edges (known stages, no self-edges,
no fan-in, stages alone on no edge, outputs), then its shape (one entry, no
cycles, every stage reachable from the entry unless alone). Each returns every
problem it finds as (key path, message, value got), for pipeline.py to raise at
those paths."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrator.server.pipeline import PipelineConfig

Loc = tuple[str | int, ...]


def names_and_edges(config: PipelineConfig) -> list[tuple[Loc, str, Any]]:
    problems: list[tuple[Loc, str, Any]] = []
    first_at: dict[str, int] = {}
    for i, stage in enumerate(config.stages):
        if stage.name in first_at:
            message = f"duplicate stage name (first at stages.{first_at[stage.name]})"
            problems.append((("stages", i, "name"), message, stage.name))
        first_at.setdefault(stage.name, i)
    known = f"unknown stage; expected one of {', '.join(first_at)}"
    incoming_at: dict[str, int] = {}
    for k, edge in enumerate(config.edges):
        for key, name in (("from", edge.from_), ("to", edge.to)):
            if name not in first_at:
                problems.append((("edges", k, key), known, name))
        if edge.from_ == edge.to:
            problems.append((("edges", k, "to"), "expected another stage (no self-edges)", edge.to))
        elif edge.to in incoming_at:
            message = (
                f"expected at most one edge into a stage, and edges.{incoming_at[edge.to]} "
                "already leads here (fan-in is not supported yet)"
            )
            problems.append((("edges", k, "to"), message, edge.to))
        incoming_at.setdefault(edge.to, k)
    alone = {s.name for s in config.stages if s.alone}
    for k, edge in enumerate(config.edges):
        for key, name in (("from", edge.from_), ("to", edge.to)):
            if name in alone:
                message = "a stage alone is on no edge (requests reach it by its name)"
                problems.append((("edges", k, key), message, name))
    seen: set[str] = set()
    for i, name in enumerate(config.output_stages or ()):
        if name not in first_at:
            problems.append((("outputs", i), known, name))
        elif name in alone:
            message = "a stage alone is on no request's path (its own requests reach the client)"
            problems.append((("outputs", i), message, name))
        elif name in seen:
            problems.append((("outputs", i), "expected each stage once", name))
        seen.add(name)
    return problems


def shape(config: PipelineConfig) -> list[tuple[Loc, str, Any]]:
    """One entry, no cycles. With at most one edge into each stage the graph is a
    forest, so "every stage reachable from the entry" is "exactly one root"."""
    parent = {e.to: (k, e.from_) for k, e in enumerate(config.edges)}
    problems: list[tuple[Loc, str, Any]] = []
    reported: set[str] = set()
    for start in config.names:
        path, name = [start], start
        while name in parent and parent[name][1] not in path:
            name = parent[name][1]
            path.append(name)
        if name in parent and not reported.intersection(path):
            flow = path[path.index(parent[name][1]) :][::-1]  # upstream first
            reported.update(flow)
            # Blame the edge written last (it closes the loop) and start the loop
            # where that edge leads, so the message reads in file order.
            k, closer = max((parent[n][0], n) for n in flow)
            at = flow.index(closer)
            loop = " -> ".join([*flow[at:], *flow[:at], closer])
            problems.append((("edges", k, "to"), f"expected no cycles, found {loop}", closer))
    roots = [
        (i, s.name) for i, s in enumerate(config.stages) if s.name not in parent and not s.alone
    ]
    for i, name in roots[1:]:
        message = (
            f"stage is not reachable from the entry stage {roots[0][1]!r}; expected an edge "
            "leading to it (a pipeline has exactly one entry), or alone: true"
        )
        problems.append((("stages", i, "name"), message, name))
    if not roots and not problems:
        problems.append((("edges",), "expected one entry stage that no edge leads to", None))
    return problems
