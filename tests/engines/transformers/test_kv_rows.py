"""KvRows' cache layers append in place (no copy of the whole cache per decode step)
and give the logits that a plain full forward gives."""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from services.engines.transformers.kv_rows import GrowingLayer, KvRows
from tests.helpers.float_error import assert_float32_close
from tests.helpers.stage import TINY_LLAMA


@torch.inference_mode()
def test_decode_steps_write_in_place_and_match_a_full_forward() -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=300, **TINY_LLAMA)).eval()
    exact = copy.deepcopy(model).double()
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    embed = model.get_input_embeddings()
    kv = KvRows(model)
    kv.add_rows(2)
    assert all(type(layer) is GrowingLayer for layer in kv.cache.layers)
    logits, _ = kv.forward(embed(ids[:, :12]), torch.ones(2, 12, dtype=torch.long), False)
    steps = [logits]
    pointers = set()
    for column in range(12, 20):
        logits, _ = kv.forward(
            embed(ids[:, column : column + 1]), torch.ones(2, 1, dtype=torch.long), False
        )
        steps.append(logits)
        pointers.add(kv.cache.layers[0].keys.data_ptr())
    # 12 columns leave room for 16 more: eight steps, one buffer.
    assert len(pointers) == 1 and kv.width == 20
    full = model(input_ids=ids).logits[:, 11:]
    reference = exact(input_ids=ids).logits[:, 11:]
    assert_float32_close(torch.stack(steps, dim=1), full, reference)
