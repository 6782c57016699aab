"""The memory planner (docs/design.md, 'Memory planning'), as plain arithmetic.

bytes_per_page = 2 * head_dim * kv_heads / tp * page_size * dtype_bytes * layers
cache_pages    = (free_before * memory_ratio - model_bytes) / bytes_per_page
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from services.engines.base import KvGeometry


@dataclass(frozen=True)
class MemoryPlan:
    free_before_bytes: int
    memory_ratio: float
    model_bytes: int
    page_size: int
    bytes_per_page: int
    cache_pages: int

    @property
    def cache_budget_bytes(self) -> int:
        return self.cache_pages * self.bytes_per_page


def bytes_per_page(kv: KvGeometry, page_size: int) -> int:
    return (
        2
        * kv.head_dim
        * (kv.kv_heads // kv.tensor_parallel)
        * page_size
        * kv.dtype_bytes
        * (kv.layers)
    )


def plan_memory(
    free_before: int, memory_ratio: float, model_bytes: int, kv: KvGeometry | None, page_size: int
) -> MemoryPlan:
    per_page = bytes_per_page(kv, page_size) if kv else 0
    budget = int(free_before * memory_ratio) - model_bytes
    pages = max(budget, 0) // per_page if per_page else 0
    return MemoryPlan(free_before, memory_ratio, model_bytes, page_size, per_page, pages)


def engine_sized(
    memory_ratio: float, model_bytes: int, kv: KvGeometry | None, pages: int, page_size: int
) -> MemoryPlan:
    """The plan of an engine that sized its KV cache itself (services.engines.base.
    SizesKvCache): its ``pages`` as they are, free memory not measured (0)."""
    per_page = bytes_per_page(kv, page_size) if kv else 0
    return MemoryPlan(0, memory_ratio, model_bytes, page_size, per_page, pages)


def free_device_memory(device: str) -> int:
    """Free bytes on ``device`` now: CUDA's free memory, or the host's available RAM."""
    if device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    return int(psutil.virtual_memory().available)
