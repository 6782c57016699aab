"""The decoder's forward without transformers' per-call machinery, for Llama-shaped models.

Once the linears run from the GGUF blocks (block_linear.py), a SmolLM2 decode step
spends about three quarters of its time in Python: transformers' decorators,
output capturing, mask building, and one module call per projection (py-spy: the
kernels are 19 % of it). This forward does the same arithmetic with the model's own
modules and weights, in as few calls as possible:

- q, k and v are one product, and gate and up another, where their weights are
  blocks of one kind (``fuse``, fused_linears.py): the fused blocks are concatenated once and the
  original modules' buffers become views of them, so nothing is held twice;
- the norms, rotary embeddings and SDPA are transformers' own functions, so each
  position's numbers are the ones the model's own forward computes;
- no mask is built for a batch of decode rows with no padding;
- where the block kernels are built and the norms are Llama's (float32), the glue
  between the products is one C call each (fused_ops.py): the residual add with the
  next norm, rotary in place on the fused qkv product (q, k and v are views of it),
  SiLU times up, and attention for one query per row (a padded batch's mask too).

It applies to decoders whose layers are ``input_layernorm``, ``self_attn`` (q, k, v,
o projections, optional per-head q/k norms), ``post_attention_layernorm`` and a
gated SiLU ``mlp``, over full attention (``lean_applies`` says why not otherwise):
Llama, Mistral, Qwen2 and Qwen3 are. Everything else keeps the model's forward.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional
from transformers import PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from services.engines.transformers import fused_ops
from services.engines.transformers.decode_stack import DecodeStack, StackParts
from services.engines.transformers.fused_linears import fuse

# attend(layer index, q [R, heads, W, D], k, v [R, kv heads, W, D]) -> [R, W, heads * D]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "smollm3")


def lean_applies(model: PreTrainedModel) -> str | None:
    """Why the lean forward cannot run ``model``, or None when it can."""
    config = model.config
    if config.model_type not in _ARCHITECTURES:
        return f"{config.model_type} is not one of {', '.join(_ARCHITECTURES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"its activation is {config.hidden_act}, not silu"
    if config._attn_implementation not in ("sdpa", "omni_mixed"):
        return f"it runs {config._attn_implementation} attention, not SDPA"
    layer_types = getattr(config, "layer_types", None)
    # Without layer_types, transformers slides wherever sliding_window is set (Mistral's
    # default is 4096): cache_utils.get_layer_types_and_kwargs.
    if (
        getattr(config, "use_sliding_window", False)
        or any(kind != "full_attention" for kind in (layer_types or ()))
        or (layer_types is None and getattr(config, "sliding_window", None) is not None)
    ):
        return "it has sliding-window layers"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "it splits its projections (pretraining_tp)"
    return None


@dataclass
class _Layer:
    attn: nn.Module  # the model's own attention module (scaling, GQA groups for SDPA)
    norm_in: nn.Module
    norm_post: nn.Module
    qkv: Callable[[torch.Tensor], torch.Tensor]
    qkv_sizes: list[int]
    o_proj: nn.Module
    gate_up: Callable[[torch.Tensor], torch.Tensor]
    down: nn.Module
    q_norm: nn.Module | None
    k_norm: nn.Module | None


class LeanForward:
    def __init__(self, model: PreTrainedModel) -> None:
        inner = model.model
        self.rotary = inner.rotary_emb
        self.norm = inner.norm
        self.lm_head = model.lm_head
        config = model.config
        self.head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.layers = []
        for layer in inner.layers[: config.num_hidden_layers]:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, sizes = fuse([attn.q_proj, attn.k_proj, attn.v_proj])
            gate_up, _ = fuse([mlp.gate_proj, mlp.up_proj])
            self.layers.append(
                _Layer(
                    attn=attn,
                    norm_in=layer.input_layernorm,
                    norm_post=layer.post_attention_layernorm,
                    qkv=qkv,
                    qkv_sizes=sizes,
                    o_proj=attn.o_proj,
                    gate_up=gate_up,
                    down=mlp.down_proj,
                    q_norm=getattr(attn, "q_norm", None),
                    k_norm=getattr(attn, "k_norm", None),
                )
            )
        norms = [self.norm, *(n for la in self.layers for n in (la.norm_in, la.norm_post))]
        # The C glue where it is built and every norm is one it computes exactly so.
        self.fused = fused_ops.unavailable() is None and all(map(fused_ops.plain_rms_norm, norms))
        # A decode step's whole stack in one C call, where the layers are ones it reads
        # (decode_stack.py); why not otherwise.
        self.stack: DecodeStack | None = None
        self.stack_declined: str | None = "the C glue does not apply"
        if self.fused:
            self.stack, self.stack_declined = self._decode_stack(config)

    def _decode_stack(self, config: object) -> tuple[DecodeStack | None, str | None]:
        dim, sizes = self.head_dim, self.layers[0].qkv_sizes
        parts = [
            StackParts(
                norm_in=layer.norm_in,
                norm_post=layer.norm_post,
                qkv=layer.qkv,
                o=layer.o_proj,
                gate_up=layer.gate_up,
                down=layer.down,
                scale=float(layer.attn.scaling),  # type: ignore[arg-type]
                per_head_norms=layer.q_norm is not None or layer.k_norm is not None,
            )
            for layer in self.layers
        ]
        return DecodeStack.of(
            parts,
            self.norm,
            heads=sizes[0] // dim,
            kv_heads=sizes[1] // dim,
            dim=dim,
            size=int(getattr(config, "hidden_size", 0)),
            inter=int(getattr(config, "intermediate_size", 0)),
        )

    def rotary_rows(
        self, embeds: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables of R * W positions, each [R * W, head_dim], contiguous."""
        count = positions.numel()
        cos, sin = self.rotary(embeds, positions)
        return cos.reshape(count, self.head_dim).contiguous(), sin.reshape(
            count, self.head_dim
        ).contiguous()

    def __call__(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend,
        keep: torch.Tensor | None,
        hidden: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``embeds`` [R, W, hidden] at ``positions`` [R, W]. Returns float32 logits
        of the kept positions (``keep``: indices into the flattened R * W positions;
        None: each row's last) and, when ``hidden``, the last hidden state there."""
        if self.fused and embeds.dtype == torch.float32:
            return self._fused(embeds, positions, attend, keep, hidden)
        rows, width, _ = embeds.shape
        cos, sin = self.rotary(embeds, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        h = embeds
        for index, layer in enumerate(self.layers):
            x = layer.norm_in.forward(h)
            q, k, v = layer.qkv(x).split(layer.qkv_sizes, dim=-1)
            q = q.view(rows, width, -1, self.head_dim)
            k = k.view(rows, width, -1, self.head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                q, k = layer.q_norm.forward(q), layer.k_norm.forward(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = v.view(rows, width, -1, self.head_dim).transpose(1, 2)
            q, k = _rotate(q, k, cos, sin)
            h = h + layer.o_proj(attend(index, q, k, v))
            gate, up = layer.gate_up(layer.norm_post.forward(h)).chunk(2, dim=-1)
            h = h + layer.down(functional.silu(gate) * up)
        picked = h[:, -1] if keep is None else h.reshape(rows * width, -1)[keep]
        state = self.norm.forward(picked)
        return self.lm_head(state).float(), state if hidden else None

    def _fused(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend,
        keep: torch.Tensor | None,
        hidden: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``__call__`` with the C glue: the residual stream ``h`` [R * W, hidden] is
        one buffer that each layer's outputs are added into, in the pass that also
        normalises it for the next product."""
        rows, width, size = embeds.shape
        positions_n, dim = rows * width, self.head_dim
        cos, sin = self.rotary_rows(embeds, positions)
        h = embeds.reshape(positions_n, size).clone()  # added into in place: not the caller's
        delta: torch.Tensor | None = None
        for index, layer in enumerate(self.layers):
            qkv = layer.qkv(fused_ops.add_rms_norm(h, delta, layer.norm_in))
            heads, kv_heads = layer.qkv_sizes[0] // dim, layer.qkv_sizes[1] // dim
            if layer.q_norm is not None and layer.k_norm is not None:
                per_head = qkv.view(positions_n, -1, dim)
                per_head[:, :heads] = layer.q_norm.forward(per_head[:, :heads])
                per_head[:, heads : heads + kv_heads] = layer.k_norm.forward(
                    per_head[:, heads : heads + kv_heads]
                )
            fused_ops.rotary_(qkv, heads + kv_heads, dim, cos, sin)
            grid = qkv.view(rows, width, -1, dim).transpose(1, 2)  # views, no copies
            out = attend(
                index,
                grid[:, :heads],
                grid[:, heads : heads + kv_heads],
                grid[:, heads + kv_heads :],
            )
            x = fused_ops.add_rms_norm(
                h, layer.o_proj(out).reshape(positions_n, size), layer.norm_post
            )
            delta = layer.down(fused_ops.silu_mul(layer.gate_up(x))).reshape(positions_n, size)
        states = fused_ops.add_rms_norm(h, delta, self.norm)
        # Each row's last position, contiguous: not a view that holds all R * W rows.
        picked = (
            states.view(rows, width, size)[:, -1].contiguous() if keep is None else states[keep]
        )
        return self.lm_head(picked).float(), picked if hidden else None


def _rotate(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' apply_rotary_pos_emb, written out (same operations, same order)."""
    return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def sdpa(layer_attn: nn.Module, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
         mask: torch.Tensor | None, fused: bool = False) -> torch.Tensor:  # fmt: skip
    """Attention for one layer: [R, W, heads * D]. One query per row (a decode step)
    calls torch's SDPA directly (grouped-query, no mask without padding): half the
    time of transformers' wrapper around it for one query; with ``fused`` (the lean
    forward's C glue), the C kernel; wider steps go through transformers' SDPA."""
    if q.shape[2] == 1:
        scale = float(layer_attn.scaling)  # type: ignore[arg-type]
        return _one_query(q, keys, values, mask, scale, fused)
    out, _ = sdpa_attention_forward(
        layer_attn,
        q,
        keys,
        values,
        mask,
        dropout=0.0,
        scaling=float(layer_attn.scaling),  # type: ignore[arg-type]
    )
    return out.reshape(*out.shape[:2], -1)


def _one_query(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    fused: bool,
) -> torch.Tensor:
    """softmax(q k^T * scale) v for q [R, heads, 1, D] against keys/values [R, kv heads,
    K, D] read in place (no repeated kv heads), as [R, 1, heads * D]: in C with
    ``fused`` where the kernel reads the layout, else torch's SDPA."""
    if fused:
        out = fused_ops.attend_one(q, keys, values, mask, scale)
        if out is not None:
            return out
    rows, heads, _one, dim = q.shape
    out = functional.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.reshape(rows, 1, heads * dim)


_LEAN: weakref.WeakKeyDictionary[PreTrainedModel, LeanForward | None] = weakref.WeakKeyDictionary()


def lean_of(model: PreTrainedModel) -> LeanForward | None:
    """The model's lean forward, built on first use; None where it does not apply
    or was turned off (``keep_transformers_forward``)."""
    if model not in _LEAN:
        _LEAN[model] = LeanForward(model) if lean_applies(model) is None else None
    return _LEAN[model]


def keep_transformers_forward(model: PreTrainedModel) -> None:
    """Run ``model`` through its own forward (``engine_args.lean_forward: false``)."""
    _LEAN[model] = None
