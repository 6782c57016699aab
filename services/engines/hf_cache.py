"""A ``KvCache`` as transformers' forwards want a cache, for the runners that call a
model's own forward (transformers' reference runner, the Qwen3-Omni thinker and
talker). Kept apart from ``kv_cache.py`` so the cache itself imports no model library.

``transformers_cache`` hands a model a ``DynamicCache`` whose layers are views of the
``KvCache``: each layer's ``update`` writes its new columns there (``reserve`` first,
``extend`` after). ``cache_argument`` names the forward's cache keyword: transformers
5.24 renamed ``past_key_values`` to ``cache`` (the old name warns), and vLLM's
environment holds an older transformers.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

from services.engines.kv_cache import KvCache

# One adapter per cache, made on its first forward and gone with the cache.
_ADAPTERS: weakref.WeakKeyDictionary[KvCache, DynamicCache] = weakref.WeakKeyDictionary()


def cache_argument(forward: Callable[..., Any]) -> str:
    """The keyword ``forward`` takes its cache by: ``cache`` or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def transformers_cache(kv: KvCache, config: PretrainedConfig) -> DynamicCache:
    """``kv`` as a transformers ``Cache`` for a model's own forward."""
    adapter = _ADAPTERS.get(kv)
    if adapter is None:
        adapter = DynamicCache(config=config)
        adapter.layers = [_Layer(kv, i) for i in range(kv.shape.layers)]
        _ADAPTERS[kv] = adapter
    return adapter


class _Layer(DynamicLayer):
    """One layer of a ``KvCache`` as transformers' forwards call a cache layer."""

    def __init__(self, cache: KvCache, index: int) -> None:  # no super(): keys are views
        self._cache, self._index = cache, index
        self.is_initialized = True
        self.device = cache.shape.device

    @property
    def keys(self) -> torch.Tensor:  # type: ignore[override]
        return self._cache.layer(self._index)[0]

    @property
    def values(self) -> torch.Tensor:  # type: ignore[override]
        return self._cache.layer(self._index)[1]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._cache.write(self._index, key_states, value_states)

    def get_seq_length(self) -> int:
        return self._cache.width

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.width + query_length, 0
