"""The fast CPU runner: a Llama-shaped decoder whose linears are on GGUF blocks.

A decode step (one new position a row, fewer than MANY_ROWS rows) runs the whole
layer stack in one call of the kernels (``decode_stack``: every layer inside one
OpenMP region, the keys and values written into the cache in place); only the
output head is a separate product. So do prefills, row by row (the stack's
``sequence``: a row's new positions as the stack's rows, each attending the columns
up to its own, its padding masked), on 8-bit activations at any length and on float32
below MANY_ROWS positions. Longer float32 prefills and mixed steps (prefill and
decode rows in one forward, so the weights are read once) run the lean forward
(lean.py), its attention per part, each part against its own cache and mask.

It takes a model when the lean forward does, every projection is on blocks (q, k, v
and gate, up fused), every norm is Llama's float32 RMSNorm (Qwen3's per-head q/k
norms too) and the kernels run here; ``llama_cpu_refuses`` says why not otherwise,
and the reference runner (transformers' forward) runs it.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from services import kernels
from services.engines.kv_cache import KvCache
from services.engines.transformers.runners.kv_budget import KvBudget
from services.engines.transformers.runners.lean import (
    Layer,
    LeanForward,
    attention_mask,
    lean_refuses,
    sdpa,
)
from services.engines.transformers.runners.text_runner import (
    DecodePart,
    Forwarded,
    PrefillPart,
    TextRunner,
)
from services.engines.transformers.weights.blocks import MANY_ROWS, BlockLinear
from services.kernels.stack import BlockWeight, DecodeStack, StackLayer, StackShape

# The model families whose RMSNorm is Llama's: float32 weight * (x * rsqrt(mean(x^2) +
# variance_epsilon)), what the kernels compute. Gemma's scales by (1 + weight).
_PLAIN_RMS_NORMS = frozenset(
    {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "SmolLM3RMSNorm"}
)


def _plain_norm(module: nn.Module | None) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ in _PLAIN_RMS_NORMS
        and isinstance(getattr(module, "variance_epsilon", None), float)
        and isinstance(weight, torch.Tensor)
        and weight.dtype == torch.float32
        and weight.dim() == 1
    )


def llama_cpu_refuses(model: PreTrainedModel) -> str | None:
    """Why this runner cannot run ``model`` (before its linears are fused), or None."""
    why = lean_refuses(model) or kernels.unavailable()
    if why is not None:
        return why
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return f"it runs float32 on the CPU, not {model.dtype} on {model.device.type}"
    for index, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for name, module in (
            ("q_proj", attn.q_proj),
            ("k_proj", attn.k_proj),
            ("v_proj", attn.v_proj),
            ("o_proj", attn.o_proj),
            ("gate_proj", mlp.gate_proj),
            ("up_proj", mlp.up_proj),
            ("down_proj", mlp.down_proj),
        ):
            if type(module) is not BlockLinear:
                return f"layer {index}'s {name} is not on GGUF blocks"
        if len({attn.q_proj.kind, attn.k_proj.kind, attn.v_proj.kind}) != 1 or (
            mlp.gate_proj.kind != mlp.up_proj.kind
        ):
            return f"layer {index}'s q, k, v (or gate, up) are blocks of different kinds"
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [n for n in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)) if n]
        if not all(map(_plain_norm, norms)):
            return f"layer {index} has a norm that is not Llama's float32 RMSNorm"
    if not _plain_norm(model.model.norm):
        return "its final norm is not Llama's float32 RMSNorm"
    return None


def _weight(module: object) -> BlockWeight:
    assert isinstance(module, BlockLinear)
    return BlockWeight(qs=module.qs, d=module.d, m=module.m, bias=module.bias,
                       packed=module.packed)  # fmt: skip


def _norm(module: nn.Module | None) -> tuple[torch.Tensor | None, float]:
    """A plain RMSNorm's weight and epsilon (None, 0 for no norm)."""
    if module is None:
        return None, 0.0
    weight, eps = module.weight, module.variance_epsilon
    assert isinstance(weight, torch.Tensor) and isinstance(eps, float), "a plain RMSNorm"
    return weight, eps


def _layer(layer: Layer) -> StackLayer:
    """A lean layer as the stack's, part by part under the same names."""
    (norm_in, eps_in), (norm_post, eps_post) = _norm(layer.norm_in), _norm(layer.norm_post)
    (q_norm, eps_head), (k_norm, _) = _norm(layer.q_norm), _norm(layer.k_norm)
    assert norm_in is not None and norm_post is not None, "a Llama layer has both norms"
    return StackLayer(
        norm_in=norm_in, eps_in=eps_in, norm_post=norm_post, eps_post=eps_post,
        q_norm=q_norm, k_norm=k_norm, eps_head=eps_head,
        qkv=_weight(layer.qkv), o=_weight(layer.o_proj),
        gate_up=_weight(layer.gate_up), down=_weight(layer.down),
        scale=float(layer.attn.scaling),  # type: ignore[arg-type]
    )  # fmt: skip


def decode_stack(lean: LeanForward, config: object) -> DecodeStack:
    """The kernels' DecodeStack over these layers (each checked as it is built)."""
    sizes, dim = lean.layers[0].qkv_sizes, lean.head_dim
    size, inter = (int(getattr(config, key, 0)) for key in ("hidden_size", "intermediate_size"))
    shape = StackShape(heads=sizes[0] // dim, kv_heads=sizes[1] // dim, dim=dim, size=size,
                       inter=inter)  # fmt: skip
    norm, eps = _norm(lean.norm)
    assert norm is not None, "the model has a final norm"
    return DecodeStack.build([_layer(layer) for layer in lean.layers], norm, eps, shape)


class LlamaCpuRunner(TextRunner):
    mixes = True

    def __init__(self, model: PreTrainedModel, budget: KvBudget | None) -> None:
        why = llama_cpu_refuses(model)
        if why is not None:
            raise ValueError(why)
        super().__init__(model, budget)
        self.lean = LeanForward(model)
        self._stack = decode_stack(self.lean, model.config)
        # the products' activations, as loading set them on every block linear
        qkv = self.lean.layers[0].qkv
        self.int8 = bool(isinstance(qkv, BlockLinear) and qkv.int8)
        self.stack_steps = 0  # decode steps the stack ran (metrics, tests)
        self.stack_prefills = 0  # prefills it ran, row by row (tests)

    def forward(
        self, kv: KvCache, embeds: torch.Tensor, valid: torch.Tensor, hidden: bool
    ) -> Forwarded:
        if embeds.shape[1] == 1 and 0 < kv.rows < MANY_ROWS and kv.width > 0:
            return self._stack_step(kv, embeds, valid, hidden)
        if self._stack_takes_prefill(kv, embeds, valid):
            return self._stack_prefill(kv, embeds, valid, hidden)
        mask = attention_mask(kv.mask, valid)
        kv.reserve(embeds.shape[1])

        def attend(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys, values = kv.write(index, k, v)
            return sdpa(self.lean.layers[index].attn, q, keys, values, mask)

        logits, states = self.lean(embeds, kv.positions(valid), attend, None, hidden)
        kv.extend(valid)
        return logits, states

    def _stack_step(
        self, kv: KvCache, embeds: torch.Tensor, valid: torch.Tensor, hidden: bool
    ) -> Forwarded:
        rows, column = kv.rows, kv.width
        cos, sin = self.lean.rotary_rows(embeds, kv.positions(valid))
        seen = torch.cat([kv.mask, valid], dim=1)
        mask = None if bool(seen.all()) else seen.to(torch.uint8)
        kv.reserve(1)
        h = embeds.reshape(rows, -1).clone()  # the residual stream, added into in place
        states = self._stack.step(h, cos, sin, kv.keys, kv.values, mask, column, self.int8)
        kv.extend(valid)
        self.stack_steps += 1
        return self.lean.lm_head(states).float(), states if hidden else None

    def _stack_takes_prefill(self, kv: KvCache, embeds: torch.Tensor, valid: torch.Tensor) -> bool:
        """Whether the stack takes this prefill row by row, each row's new positions a
        sequence: every row has some (its last ones: padding on the left), on 8-bit
        activations or fewer than MANY_ROWS positions (from there float32's products
        are the dequantised weight through torch's matmul)."""
        if not 0 < kv.rows < MANY_ROWS or embeds.shape[1] < 2:
            return False
        if not self.int8 and embeds.shape[1] >= MANY_ROWS:
            return False
        left_padded = bool((valid[:, 1:] >= valid[:, :-1]).all())
        return left_padded and bool(valid[:, -1].all())

    def _stack_prefill(
        self, kv: KvCache, embeds: torch.Tensor, valid: torch.Tensor, hidden: bool
    ) -> Forwarded:
        """Each row's new positions through the decode stack as a sequence: every layer
        in one call, the positions written into the row's cache in place, its padding
        columns (left as they are, zero) masked (the kernels' glue and attention: bit
        for bit the positions stepped one by one, so a row's prefill is the same
        whatever else is in its batch, padded or not)."""
        width, column = embeds.shape[1], kv.width
        cos, sin = self.lean.rotary_rows(embeds, kv.positions(valid))
        kv.reserve(width)
        seen = torch.cat([kv.mask, valid], dim=1).to(torch.uint8)
        last = []
        for row, real in enumerate(valid.sum(1).tolist()):
            pad = width - real
            at = slice(row * width + pad, (row + 1) * width)
            mask = None if bool(seen[row].all()) else seen[row : row + 1].contiguous()
            states = self._stack.step(
                embeds[row, pad:].clone(), cos[at], sin[at],
                kv.keys[:, row : row + 1], kv.values[:, row : row + 1],
                mask, column + pad, self.int8, sequence=True,
            )  # fmt: skip
            last.append(states[-1])
        kv.extend(valid)
        self.stack_prefills += 1
        final = torch.stack(last)
        return self.lean.lm_head(final).float(), final if hidden else None

    def mixed_forward(self, prefill: PrefillPart, decode: DecodePart, hidden: bool) -> Forwarded:
        """One flat sequence: the prefill rows' W columns each, then one column per
        decode row. The linears, norms and rotary are per position; attention runs
        per part, each against its own cache with its own mask."""
        (kv_p, embeds_p, valid_p), (kv_d, embeds_d) = prefill, decode
        valid_d = torch.ones(embeds_d.shape[:2], dtype=torch.long, device=embeds_d.device)
        parts = [(kv_p, valid_p), (kv_d, valid_d)]
        masks = [attention_mask(kv.mask, valid) for kv, valid in parts]
        for kv, valid in parts:
            kv.reserve(valid.shape[1])
        flat = torch.cat(
            [
                embeds_p.reshape(1, -1, embeds_p.shape[-1]),
                embeds_d.reshape(1, -1, embeds_d.shape[-1]),
            ],
            1,
        )
        positions = torch.cat([kv.positions(valid).reshape(1, -1) for kv, valid in parts], 1)
        width_p = valid_p.shape[1]
        keep = torch.cat(
            [
                torch.arange(valid_p.shape[0]) * width_p + width_p - 1,
                valid_p.numel() + torch.arange(valid_d.shape[0]),
            ]
        ).to(flat.device)

        def attend(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            outputs, start = [], 0
            for (kv, valid), mask in zip(parts, masks, strict=True):
                rows, width = valid.shape
                end = start + rows * width
                mine = [_rows_of(t[0, :, start:end], rows) for t in (q, k, v)]
                keys, values = kv.write(index, mine[1], mine[2])
                out = sdpa(self.lean.layers[index].attn, mine[0], keys, values, mask)
                outputs.append(out.reshape(1, rows * width, -1))
                start = end
            return torch.cat(outputs, dim=1)

        logits, states = self.lean(flat, positions, attend, keep, hidden)
        for kv, valid in parts:
            kv.extend(valid)
        return logits, states


def _rows_of(flat: torch.Tensor, rows: int) -> torch.Tensor:
    """[heads, rows * W, dim] -> [rows, heads, W, dim]"""
    heads, length, dim = flat.shape
    return flat.view(heads, rows, length // rows, dim).transpose(0, 1)
