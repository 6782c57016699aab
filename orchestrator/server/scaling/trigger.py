"""What a KEDA trigger asks of the orchestrator, read from its metadata.

KEDA passes a ScaledObject trigger's whole ``metadata`` map on every call
(``ScaledObjectRef.scalerMetadata``; ``scalerAddress`` and KEDA's own keys
included, which are not ours and are left alone). Ours:

- ``stage``: the pipeline's stage to scale (required);
- ``targetPerReplica``: the requests one replica should carry, waiting and in
  flight together (a positive number; required where the metric's target is
  asked: GetMetricSpec).

A missing or malformed key is INVALID_ARGUMENT naming it; a stage the pipeline
does not have is NOT_FOUND naming it. KEDA shows the message on its ScaledObject.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from services.mesh.errors import InvalidArgument, NotFound

FIELD = "scalerMetadata"
STAGE = f"{FIELD}.stage"
TARGET = f"{FIELD}.targetPerReplica"


@dataclass(frozen=True)
class Trigger:
    stage: str
    target: float | None  # targetPerReplica, None where it was not given

    @property
    def metric_name(self) -> str:
        # KEDA prefixes it with the trigger's index ("s0-") for the HPA; a valid
        # metric name needs no more than the stage's (a DNS label) around it.
        return f"omni-{self.stage}-requests"


def read_trigger(
    metadata: Mapping[str, str], stages: Collection[str], *, needs_target: bool = False
) -> Trigger:
    """The trigger ``metadata`` describes, for a pipeline of ``stages``."""
    names = ", ".join(sorted(stages))
    stage = metadata.get("stage", "").strip()
    if not stage:
        raise InvalidArgument(f"{STAGE}: missing (the stage to scale: one of {names})", field=STAGE)
    if stage not in stages:
        raise NotFound(
            f"{STAGE}: the pipeline has no stage {stage!r} (it has {names})", field=STAGE
        )
    text = metadata.get("targetPerReplica")
    if text is None:
        if needs_target:
            raise InvalidArgument(
                f'{TARGET}: missing (the requests one replica should carry, e.g. "4")',
                field=TARGET,
            )
        return Trigger(stage, None)
    try:
        target = float(text)
    except ValueError:
        target = math.nan
    if not (math.isfinite(target) and target > 0):
        raise InvalidArgument(
            f"{TARGET}: {text!r} is not a positive number of requests", field=TARGET
        )
    return Trigger(stage, target)
