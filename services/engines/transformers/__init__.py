"""The transformers engine: the CPU default, loading HF folders and GGUF files."""

from __future__ import annotations

from services.engines.transformers.engine import TransformersEngine

__all__ = ["TransformersEngine"]
