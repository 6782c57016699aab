"""The pipeline as the API's one model: named by the pipeline, its stages listed
with it, learnt from the orchestrator's ListStages (asked with the caller's
token). Its name and stages do not change while the orchestrator runs, so once
every stage has described itself the answer is kept."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from orchestrator.client import AsyncClient
from services.gateway.errors import ApiError
from services.mesh.pb.omni.v1 import orchestrator_pb2

# OpenAI's realtime model names, present and future (gpt-realtime, gpt-realtime-2.1,
# gpt-4o-realtime-preview-2025-06-03, gpt-4o-mini-realtime-preview): voice-agent
# frameworks dial one by default, and on /v1/realtime each is served by the
# pipeline as an OpenAI voice name is served by the speaker's default voice.
OPENAI_REALTIME = re.compile(r"gpt-(4o-(mini-)?)?realtime(-[\w.-]+)?")


@dataclass(frozen=True)
class Pipeline:
    name: str
    stages: tuple[orchestrator_pb2.StageStatus, ...]

    @property
    def described(self) -> bool:
        """Every stage has answered Describe (its engine is known)."""
        return all(stage.engine for stage in self.stages)

    @property
    def entry(self) -> orchestrator_pb2.StageStatus:
        """The stage a request enters by: listed first (every pipeline file of the
        mesh lists its entry stage first)."""
        return self.stages[0]

    @property
    def image_stage(self) -> str | None:
        """The first stage that outputs images (a diffusion stage), if any."""
        return next((s.name for s in self.stages if "image" in s.output_tensors), None)

    @property
    def audio_stage(self) -> str | None:
        """The first stage that outputs audio (a speech stage), if any."""
        return next((s.name for s in self.stages if "audio" in s.output_tensors), None)

    def outputs(self, *, audio: bool = False, image: bool = False) -> list[str]:
        """What a request for text (and ``audio``, ``image``) names as its outputs
        (GenerateRequest.outputs): every pipeline output but an image stage and a
        speech stage not asked for, so they do not run for nothing. Empty, the
        default of every output, when that leaves out none (or the orchestrator
        does not say which stages are outputs)."""
        every = [s for s in self.stages if s.output]
        wanted = [
            s.name
            for s in every
            if (image or "image" not in s.output_tensors)
            and (audio or "audio" not in s.output_tensors)
        ]
        return wanted if 0 < len(wanted) < len(every) else []

    @property
    def recogniser(self) -> str | None:
        """The stage that turns speech into text for an entry stage that takes
        none (the default pipeline's whisper stage), if any: a later stage that
        accepts audio. None when the entry hears audio itself."""
        if "audio" in self.entry.accepts:
            return None
        return next((s.name for s in self.stages[1:] if "audio" in s.accepts), None)

    @property
    def hears(self) -> bool:
        """Spoken input is served: the entry stage takes audio, or a recogniser does."""
        return "audio" in self.entry.accepts or self.recogniser is not None

    @property
    def voices(self) -> list[str]:
        """The speech stage's voices, the first its default."""
        stage = next((s for s in self.stages if s.name == self.audio_stage), None)
        return list(stage.voices) if stage is not None else []

    def serves(self, model: str | None, *, realtime: bool = False) -> bool:
        """``model`` names this pipeline (None does too); with ``realtime``, so
        does any OpenAI realtime model name."""
        if model is None or model == self.name:
            return True
        return realtime and OPENAI_REALTIME.fullmatch(model) is not None

    def check_model(self, model: str | None, *, realtime: bool = False) -> None:
        """404 for a model this mesh does not serve (None: the pipeline itself)."""
        if not self.serves(model, realtime=realtime):
            raise ApiError(
                404,
                f"model {model!r} does not exist: this mesh serves {self.name!r}",
                param="model",
                code="model_not_found",
            )

    def card(self, created: int) -> dict[str, Any]:
        """The model object of /v1/models, with the pipeline's stages."""
        return {
            "id": self.name,
            "object": "model",
            "created": created,
            "owned_by": "omni-mesh",
            "stages": [
                {
                    "name": stage.name,
                    "engine": stage.engine,
                    "state": orchestrator_pb2.StageState.Name(stage.state),
                    "output_tensors": list(stage.output_tensors),
                    "accepts": list(stage.accepts),
                }
                for stage in self.stages
            ],
        }


class Catalog:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client
        self._known: Pipeline | None = None

    async def fresh(self, token: str | None) -> Pipeline:
        """Asked now (the stages' states as they are)."""
        reply = await self._client.pipeline(token=token)
        pipeline = Pipeline(reply.pipeline, tuple(reply.stages))
        if pipeline.described:
            self._known = pipeline
        return pipeline

    async def model(
        self, name: str | None, token: str | None, *, realtime: bool = False
    ) -> Pipeline:
        """The pipeline (the kept answer, else asked now), if ``name`` names it:
        404 otherwise (None: the pipeline, whatever its name)."""
        pipeline = self._known if self._known is not None else await self.fresh(token)
        pipeline.check_model(name, realtime=realtime)
        return pipeline
