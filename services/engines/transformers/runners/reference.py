"""The reference runner: any causal LM transformers can load, through its own forward.

Every step is the model's forward over the rows' padded cache (services/engines/
kv_cache.py as a transformers ``Cache``), with each row's own attention mask and
positions. It does not mix prefill and decode rows in one forward: the scheduler
runs them as two. It is the yardstick the fast path (llama_cpu.py) is tested
against, and what every model that path does not take runs on.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from services.engines.hf_cache import cache_argument, transformers_cache
from services.engines.kv_cache import KvCache
from services.engines.transformers.runners.kv_budget import KvBudget
from services.engines.transformers.runners.text_runner import Forwarded, TextRunner


def reference_refuses(model: PreTrainedModel) -> str | None:
    """Why the model cannot be batched this way, or None."""
    if any(type(layer) is not DynamicLayer for layer in DynamicCache(config=model.config).layers):
        # A sliding-window layer drops columns itself, which the mask cannot follow.
        return "only models with full-attention caches can be batched"
    return None


class ReferenceRunner(TextRunner):
    def __init__(self, model: PreTrainedModel, budget: KvBudget | None) -> None:
        why = reference_refuses(model)
        if why is not None:
            raise ValueError(why)
        super().__init__(model, budget)
        self._cache_argument = cache_argument(type(model).forward)

    def forward(
        self, kv: KvCache, embeds: torch.Tensor, valid: torch.Tensor, hidden: bool
    ) -> Forwarded:
        kv.reserve(embeds.shape[1])
        out = self.model(
            inputs_embeds=embeds,
            attention_mask=torch.cat([kv.mask, valid], dim=1),
            position_ids=kv.positions(valid),
            use_cache=True,
            output_hidden_states=hidden,
            logits_to_keep=1,  # the other columns need no logits
            **{self._cache_argument: transformers_cache(kv, self.model.config)},
        )
        kv.extend(valid)
        states = out.hidden_states[-1][:, -1] if hidden else None
        return out.logits[:, -1].float(), states
