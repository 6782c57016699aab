"""The ``diffusers`` engine: any local ``DiffusionPipeline``, with step previews."""

from services.engines.diffusers.config import DiffusersArgs
from services.engines.diffusers.dummy import build_dummy_pipeline
from services.engines.diffusers.engine import DiffusersEngine

__all__ = ["DiffusersArgs", "DiffusersEngine", "build_dummy_pipeline"]
