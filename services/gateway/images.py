"""/v1/images/generations over Orchestrator.Generate: the prompt goes through the
whole pipeline (the thinker conditions the renderer), the pipeline's diffusion
stage is asked for a PNG, and the answer is that PNG as ``b64_json``, with the
text the image was conditioned on (if a stage streamed some) as
``revised_prompt``."""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any

from orchestrator.client import Result, StageResult
from services.gateway.catalog import Pipeline
from services.gateway.errors import ApiError
from services.gateway.schema import ImageRequest
from services.mesh.pb.omni.v1 import orchestrator_pb2


def image_stage(pipeline: Pipeline) -> str:
    stage = pipeline.image_stage
    if stage is None:
        raise ApiError(
            400,
            f"model {pipeline.name!r} has no stage that draws images",
            param="model",
            code="model_not_supported",
        )
    return stage


def generate_request(
    image: ImageRequest, stage: str
) -> tuple[orchestrator_pb2.GenerateRequest, dict[str, str]]:
    """The GenerateRequest, and the map from the mesh's field paths to the request's."""
    request = orchestrator_pb2.GenerateRequest(request_id=f"img-{uuid.uuid4().hex}")
    request.inputs.messages.add(role="user", content=image.prompt)
    params = request.stage_params[stage]
    params.return_png = True
    if image.height_width is not None:
        params.height, params.width = image.height_width
    fields = {"inputs": "prompt", "params.height": "size", "params.width": "size"}
    return request, {**fields, "request_id": ""}


def images_response(result: Result, stage: str) -> dict[str, Any]:
    """The ``images`` answer of a request that succeeded."""
    drawn = result.stages.get(stage, StageResult())
    texts = [s.text for name, s in result.stages.items() if name != stage and s.text]
    item: dict[str, Any] = {"b64_json": base64.b64encode(_png(drawn)).decode()}
    if texts:
        item["revised_prompt"] = texts[0]
    return {"created": int(time.time()), "data": [item]}


def _png(drawn: StageResult) -> bytes:
    """The stage's PNG (asked for with ``return_png``)."""
    for blob in drawn.blobs:
        if blob.media_type == "image/png":
            return blob.data
    raise ApiError(502, "the image stage answered without a PNG", code="no_image")
