"""The ``vllm`` engine: vLLM v1's AsyncLLM on a GPU. vLLM itself is imported by
``VllmEngine.load`` only, so this package imports on any machine."""

from services.engines.vllm.config import VllmArgs
from services.engines.vllm.engine import INSTALL_HINT, VllmEngine

__all__ = ["INSTALL_HINT", "VllmArgs", "VllmEngine"]
