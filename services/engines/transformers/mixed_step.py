"""Prefill and decode in one forward pass: the step loop's mixed step.

When some requests are reading their prompts and others are decoding, running the
two as separate forwards reads every weight twice per step: on a CPU the decode
step is memory-bound, so the second read costs about as much as the first. Padding
the decode rows to the prefill's width instead would cost every padded position as
much as a real one. So both go through the model as one flat sequence: the prefill
rows' W columns each, then one column per decode row. The linears, norms and rotary
embeddings are per position and do not care; only attention must keep the rows
apart. It runs per part, each against its own KvRows cache with its own mask,
through transformers' own SDPA function (``omni_mixed`` below, which is plain SDPA
whenever no mixed step is under way, so the model is unchanged otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from services.engines.transformers.kv_rows import GrowingLayer, KvRows, attention_mask
from services.engines.transformers.lean_forward import lean_of

IMPLEMENTATION = "omni_mixed"


@dataclass
class _Part:
    kv: KvRows
    rows: int
    width: int  # columns per row in the flat sequence
    mask: torch.Tensor | None  # [rows, 1, width, keys] bool: what each query may see


class MixedCache:
    """What the model sees as its cache in a mixed step: each layer's new keys and
    values are split by part and appended to that part's KvRows cache."""

    def __init__(self, parts: list[_Part]) -> None:
        self.parts = parts
        self.current: list[tuple[torch.Tensor, torch.Tensor]] = []

    def update(
        self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.current, start = [], 0
        for part in self.parts:
            end = start + part.rows * part.width
            mine = [_rows_of(t[0, :, start:end], part.rows) for t in (keys, values)]
            layer = part.kv.cache.layers[layer_idx]
            assert isinstance(layer, GrowingLayer), "KvRows caches hold GrowingLayers"
            self.current.append(layer.update(mine[0], mine[1]))
            start = end
        return keys, values


def _rows_of(flat: torch.Tensor, rows: int) -> torch.Tensor:
    """[heads, rows * W, dim] -> [rows, heads, W, dim]"""
    heads, length, dim = flat.shape
    return flat.view(heads, rows, length // rows, dim).transpose(0, 1)


def _mixed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    cache = kwargs.pop("omni_mixed", None)
    if cache is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    outputs, start = [], 0
    for part, (keys, values) in zip(cache.parts, cache.current, strict=True):
        end = start + part.rows * part.width
        mine = _rows_of(query[0, :, start:end], part.rows)
        out, _ = sdpa_attention_forward(module, mine, keys, values, part.mask, **kwargs)
        outputs.append(out.reshape(1, -1, *out.shape[2:]))  # [rows, W, heads, dim] flat
        start = end
    return torch.cat(outputs, dim=1), None


ALL_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, _mixed_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, sdpa_mask)


def enable(model: PreTrainedModel) -> bool:
    """Switch ``model`` to the attention that can run mixed steps (SDPA otherwise);
    False, and the model left alone, where it does not run on SDPA."""
    if model.config._attn_implementation == IMPLEMENTATION:
        return True
    if model.config._attn_implementation != "sdpa":
        return False
    model.set_attn_implementation(IMPLEMENTATION)
    return True


def mixed_forward(
    model: PreTrainedModel,
    prefill: tuple[KvRows, torch.Tensor, torch.Tensor],
    decode: tuple[KvRows, torch.Tensor],
    hidden: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward over ``prefill`` (its KvRows, embeds [rows, W, hidden], valid [rows, W])
    and ``decode`` (its KvRows, embeds [rows, 1, hidden]). Returns float32 logits of
    each prefill row's last column, then each decode row's [rows_p + rows_d, vocab],
    and the last layer's hidden states there when ``hidden``."""
    (kv_p, embeds_p, valid_p), (kv_d, embeds_d) = prefill, decode
    valid_d = torch.ones(embeds_d.shape[:2], dtype=torch.long, device=embeds_d.device)
    parts, positions = [], []
    for kv, valid in ((kv_p, valid_p), (kv_d, valid_d)):
        rows, width = valid.shape
        parts.append(_Part(kv, rows, width, attention_mask(kv.mask, valid)))
        positions.append(kv.positions(valid).reshape(1, -1))
    flat = torch.cat(
        [embeds_p.reshape(1, -1, embeds_p.shape[-1]), embeds_d.reshape(1, -1, embeds_d.shape[-1])],
        1,
    )
    width_p = valid_p.shape[1]
    keep = torch.cat(
        [
            torch.arange(valid_p.shape[0]) * width_p + width_p - 1,
            valid_p.numel() + torch.arange(valid_d.shape[0]),
        ]
    ).to(flat.device)
    cache = MixedCache(parts)
    lean = lean_of(model)
    if lean is not None:

        def attend(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache.update(k, v, index)
            attn = lean.layers[index].attn
            out, _ = _mixed_attention(
                attn, q, k, v, None, omni_mixed=cache, dropout=0.0, scaling=attn.scaling
            )
            return out.reshape(*out.shape[:2], -1)

        logits, states = lean(flat, torch.cat(positions, dim=1), attend, keep, hidden)
        kv_p.advance(valid_p)
        kv_d.advance(valid_d)
        return logits, states
    out = model(
        inputs_embeds=flat,
        attention_mask=torch.ones(1, 1, 1, 1, dtype=torch.bool, device=flat.device),
        position_ids=torch.cat(positions, dim=1),
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=hidden,
        logits_to_keep=keep,
        omni_mixed=cache,
    )
    kv_p.advance(valid_p)
    kv_d.advance(valid_d)
    states = out.hidden_states[-1][0, keep] if hidden else None
    return out.logits[0].float(), states
