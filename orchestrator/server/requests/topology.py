"""The pipeline's graph as requests walk it: derived once from the pipeline file
(requests look it up on every message), one stage alone, or the part of it a
request's chosen outputs need; and whether an edge's transform is one its
consuming stage offers (from that stage's Describe)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from orchestrator.server.pipeline import Edge, PipelineConfig
from services.mesh.errors import InvalidArgument
from services.mesh.pb.omni.v1 import stage_pb2


@dataclass(frozen=True)
class Topology:
    """The pipeline's graph, derived once (requests look it up on every message)."""

    entry: str
    order: tuple[str, ...]
    outputs: frozenset[str]
    children: Mapping[str, tuple[Edge, ...]]
    incoming: Mapping[str, Edge | None]

    @classmethod
    def of(cls, pipeline: PipelineConfig) -> Topology:
        return cls(
            entry=pipeline.entry,
            order=pipeline.order,
            outputs=frozenset(pipeline.outputs),
            children={name: pipeline.children(name) for name in pipeline.names},
            incoming={name: pipeline.incoming(name) for name in pipeline.names},
        )

    def alone(self, stage: str) -> Topology:
        """``stage`` as a pipeline of its own: its entry, its only stage and output."""
        return Topology(stage, (stage,), frozenset({stage}), {stage: ()}, {stage: None})

    def serving(self, wanted: Sequence[str], field: str = "outputs") -> Topology:
        """The part of the graph that ``wanted`` (some of its outputs; empty: all)
        needs: those outputs and every stage on the way to one. The others do not
        run, nor does any producer make what only they would take. An unknown or
        repeated name is refused, naming ``field``."""
        if not wanted:
            return self
        known = [s for s in self.order if s in self.outputs]
        for i, name in enumerate(wanted):
            if name not in self.outputs:
                raise InvalidArgument(
                    f"{field}[{i}]: {name!r} is not one of the pipeline's outputs "
                    f"({', '.join(known)})",
                    field=f"{field}[{i}]",
                )
            if name in wanted[:i]:
                at = f"{field}[{i}]"
                raise InvalidArgument(f"{at}: {name!r} is named twice", field=at)
        keep: set[str] = set()
        for name in wanted:
            step: str | None = name
            while step is not None and step not in keep:  # back up the one path in
                keep.add(step)
                edge = self.incoming[step]
                step = edge.from_ if edge is not None else None
        if keep == set(self.order) and set(wanted) == self.outputs:
            return self
        return Topology(
            self.entry,
            tuple(s for s in self.order if s in keep),
            frozenset(wanted),
            {s: tuple(e for e in self.children[s] if e.to in keep) for s in keep},
            {s: self.incoming[s] for s in keep},
        )


def transform_needs(
    description: stage_pb2.StageDescription | None, transform: str
) -> frozenset[str] | None:
    """The tensors ``transform`` needs from the producer, as the consuming stage
    advertises them; None when that stage does not offer it (or is not described)."""
    if not transform:
        return frozenset()
    if description is None:
        return None
    for offered in description.transforms:
        if offered.name == transform:
            return frozenset(offered.needs_tensors)
    return None


def unoffered(edge: Edge, description: stage_pb2.StageDescription | None) -> str | None:
    """Why ``edge`` cannot carry requests into its stage (``description``: what that
    stage says of itself): a transform it does not offer; None when it can."""
    if transform_needs(description, edge.transform) is not None:
        return None
    offered = sorted(t.name for t in description.transforms) if description else []
    return (
        f"edge {edge.from_} -> {edge.to}: stage {edge.to} does not offer transform "
        f"{edge.transform!r} (it offers: {', '.join(offered) or 'none'})"
    )
