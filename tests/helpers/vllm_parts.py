"""What the vllm engine's tests build on: a byte-level tokenizer with a chat
template, the config of a tiny Llama over it, and requests."""

from __future__ import annotations

from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, PreTrainedTokenizerFast

from services.engines.base import EngineRequest, SamplingParams

EMBEDS = "inputs.tensors.prompt_embeds"
HIDDEN = 256  # 4 heads of 64: a head size every attention backend takes
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
CHAT_HI = "<user>hi\n<assistant>"  # CHAT_TEMPLATE applied to one user message "hi"


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level, no merges: every text encodes and decodes exactly."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def byte_ids(text: str) -> list[int]:
    """The byte tokenizer's ids for ``text``, without BOS."""
    return byte_tokenizer()(text, add_special_tokens=False).input_ids


def tiny_llama_config(vocab_size: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def request(rid: str = "r", text: str | None = "hello", **params: Any) -> EngineRequest:
    tensors = params.pop("tensors", {})
    messages = params.pop("messages", ())
    token_ids = params.pop("token_ids", ())
    return EngineRequest(
        rid,
        text=text,
        messages=messages,
        token_ids=token_ids,
        tensors=tensors,
        params=SamplingParams(**params),
    )


def embeds_request(embeds: torch.Tensor, **params: Any) -> EngineRequest:
    return request(text=None, tensors={"prompt_embeds": embeds}, **params)
