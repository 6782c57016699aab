"""The pipeline's graph as requests walk it: derived once from the pipeline file
(requests look it up on every message), or one stage alone; and whether an edge's
transform is one its consuming stage offers (from that stage's Describe)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from orchestrator.server.pipeline import Edge, PipelineConfig
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
