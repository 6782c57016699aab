"""A Llama-shaped decoder's forward without transformers' per-call machinery: the
multi-column steps (prefills, mixed steps) of the fast CPU runner (llama_cpu.py).

Once the linears run from GGUF blocks, three quarters of a SmolLM2 step was
transformers' decorators, output capturing, mask building and one module call per
projection (py-spy). This does the same arithmetic with the model's own modules:
q, k and v are one product and gate and up another (weights/fused.py); the norms,
rotary embeddings and SDPA are the model's and transformers' own functions, so each
position's numbers are the ones its own forward computes. It takes decoders whose
layers are ``input_layernorm``, ``self_attn`` (q, k, v, o, optional per-head q/k
norms), ``post_attention_layernorm`` and a gated SiLU ``mlp``, over full attention:
Llama, Mistral, Qwen2, Qwen3 (``lean_refuses`` says why not otherwise).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional
from transformers import PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from services.engines.transformers.weights.fused import fuse

# attend(layer index, q [R, heads, W, D], k, v [R, kv heads, W, D]) -> [R, W, heads * D]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "smollm3")


def lean_refuses(model: PreTrainedModel) -> str | None:
    """Why the lean forward cannot run ``model``, or None when it can."""
    config = model.config
    if config.model_type not in ARCHITECTURES:
        return f"{config.model_type} is not one of {', '.join(ARCHITECTURES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"its activation is {config.hidden_act}, not silu"
    if config._attn_implementation != "sdpa":
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
class Layer:
    attn: nn.Module  # the model's own attention module (its scaling)
    norm_in: nn.Module
    norm_post: nn.Module
    qkv: nn.Module | Callable[[torch.Tensor], torch.Tensor]
    qkv_sizes: list[int]
    o_proj: nn.Module
    gate_up: nn.Module | Callable[[torch.Tensor], torch.Tensor]
    down: nn.Module
    q_norm: nn.Module | None
    k_norm: nn.Module | None


class LeanForward:
    def __init__(self, model: PreTrainedModel) -> None:
        inner = model.model
        self.rotary, self.norm, self.lm_head = inner.rotary_emb, inner.norm, model.lm_head
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
                Layer(
                    attn,
                    layer.input_layernorm,
                    layer.post_attention_layernorm,
                    qkv,
                    sizes,
                    attn.o_proj,
                    gate_up,
                    mlp.down_proj,
                    getattr(attn, "q_norm", None),
                    getattr(attn, "k_norm", None),
                )
            )

    def rotary_rows(
        self, embeds: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables of R * W positions, each [R * W, head_dim], contiguous."""
        count = positions.numel()
        cos, sin = self.rotary(embeds, positions)
        return (
            cos.reshape(count, self.head_dim).contiguous(),
            sin.reshape(count, self.head_dim).contiguous(),
        )

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
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            h = h + layer.o_proj(attend(index, q, k, v))
            gate, up = layer.gate_up(layer.norm_post.forward(h)).chunk(2, dim=-1)
            h = h + layer.down(functional.silu(gate) * up)
        picked = h[:, -1] if keep is None else h.reshape(rows * width, -1)[keep]
        state = self.norm.forward(picked)
        return self.lm_head(state).float(), state if hidden else None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb, written out (same operations, same order)."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


def sdpa(
    attn: nn.Module,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """Attention for one layer: [R, W, heads * D]. One query per row calls torch's SDPA
    directly (grouped-query, no mask without padding): half the time of transformers'
    wrapper around it; wider steps go through transformers' SDPA."""
    scale = float(attn.scaling)  # type: ignore[arg-type]
    if q.shape[2] == 1:
        rows, heads, _one, dim = q.shape
        out = functional.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
        return out.reshape(rows, 1, heads * dim)
    out, _ = sdpa_attention_forward(attn, q, keys, values, mask, dropout=0.0, scaling=scale)
    return out.reshape(*out.shape[:2], -1)


def attention_mask(seen_before: torch.Tensor, valid: torch.Tensor) -> torch.Tensor | None:
    """What each of W new queries may see, [rows, 1, W, columns] bool, given the columns
    before (``seen_before`` [rows, C]) and the new ones (``valid`` [rows, W]): the real
    columns, causally over the new ones; a padding query still sees itself (never a row
    with nothing to attend to). None when every row sees every column (one new column
    each and no padding): SDPA then needs no mask."""
    width = valid.shape[1]
    seen = torch.cat([seen_before, valid], dim=1).bool()
    if width == 1 and bool(seen.all()):
        return None
    causal = torch.ones(width, seen.shape[1], dtype=torch.bool, device=seen.device)
    causal = causal.tril(seen.shape[1] - width)
    diagonal = torch.zeros_like(causal)
    diagonal[:, seen.shape[1] - width :] = torch.eye(width, dtype=torch.bool)
    return ((seen[:, None, :] & causal) | diagonal)[:, None]
