"""The GGUF -> safetensors conversion writes a standard HF folder that any loader
reads correctly, not only ours (vLLM does not re-tie weights: a folder holding the
tied embedding only as ``lm_head.weight`` made it generate token 0 forever)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.engines.transformers.loading import converted_folder


def test_the_folder_is_standard(smollm2_gguf: Path, omni_cache_dir: Path) -> None:
    folder = converted_folder(smollm2_gguf, omni_cache_dir)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        embedding = f.get_tensor("model.embed_tokens.weight")
    # Tied weights saved once, under the source name, as save_pretrained does.
    assert "lm_head.weight" not in names
    assert embedding.shape == (49152, 576) and embedding.abs().sum() > 0
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (folder / name).is_file(), name


def test_transformers_loads_it_as_the_gguf_itself(smollm2_gguf: Path, omni_cache_dir: Path) -> None:
    folder = converted_folder(smollm2_gguf, omni_cache_dir)
    converted = AutoModelForCausalLM.from_pretrained(folder).eval()
    reference = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        # The same weights through the same kernels in one process: equal, not close.
        assert torch.equal(converted(ids).logits, reference(ids).logits)
    assert converted.lm_head.weight.data_ptr() == converted.model.embed_tokens.weight.data_ptr()
