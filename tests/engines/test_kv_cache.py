"""The KV cache only stores: its rows join, leave and are copied with their own columns
(padding no remaining row uses is dropped), a step's columns go into room reserved
ahead (one buffer for many decode steps), and a model's own forward reading it
through the transformers adapter gives the logits of a full forward."""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from services.engines.kv_cache import KvCache, KvShape
from services.engines.transformers.runners.reference import ReferenceRunner
from services.testing.configs import TINY_LLAMA
from tests.helpers.float_error import assert_float32_close

SHAPE = KvShape(layers=2, kv_heads=2, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))


def _filled(widths: list[int], seed: int) -> KvCache:
    """Rows with ``widths`` positions each (left-padded), every key its row's number."""
    kv = KvCache(SHAPE, rows=len(widths))
    width = max(widths)
    valid = torch.zeros(len(widths), width, dtype=torch.long)
    for row, w in enumerate(widths):
        valid[row, width - w :] = 1
    kv.reserve(width)
    for layer in range(SHAPE.layers):
        keys = torch.arange(len(widths), dtype=torch.float32).view(-1, 1, 1, 1) + seed
        keys = keys.expand(-1, SHAPE.kv_heads, width, SHAPE.head_dim)
        kv.write(layer, keys, -keys)
    kv.extend(valid)
    return kv


def test_rows_leave_with_their_columns_and_join_left_padded() -> None:
    kv = _filled([5, 2, 3], seed=0)
    assert (kv.rows, kv.width) == (3, 5)
    kv.select([2, 1])  # the 5-wide row leaves: two columns no one uses go with it
    assert (kv.rows, kv.width) == (2, 3)
    assert kv.mask.tolist() == [[1, 1, 1], [0, 1, 1]]
    assert kv.next_pos.tolist() == [3, 2]
    assert kv.layer(1)[0][:, 0, :, 0].tolist() == [[2.0] * 3, [1.0] * 3]
    kv.concat(_filled([4], seed=10))
    assert (kv.rows, kv.width) == (3, 4)
    assert kv.mask.tolist() == [[0, 1, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1]]
    keys, values = kv.layer(0)
    assert keys[2, 0, :, 0].tolist() == [10.0] * 4 and torch.equal(values, -keys[:, :, :, :])
    taken = kv.take([1])
    assert (taken.rows, taken.width, kv.rows) == (1, 2, 3)  # a copy; the original kept
    kv.add_rows(2)
    assert (kv.rows, kv.width) == (5, 4) and kv.mask[3:].sum() == 0


def test_reserved_room_takes_many_steps_in_one_buffer() -> None:
    kv = _filled([12], seed=0)
    kv.reserve(1)
    pointer, room = kv.keys.data_ptr(), kv.room
    assert room >= 12 + 16
    for _ in range(room - 12):
        kv.reserve(1)
        for layer in range(SHAPE.layers):
            kv.write(layer, torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4))
        kv.extend(torch.ones(1, 1, dtype=torch.long))
    assert kv.keys.data_ptr() == pointer and kv.width == room
    kv.reserve(1)
    assert kv.keys.data_ptr() != pointer and kv.room > room  # grown: a copy, with headroom
    assert kv.layer(0)[0][0, 0, :12, 0].tolist() == [0.0] * 12  # the old columns kept


@torch.inference_mode()
def test_decode_steps_through_the_model_match_a_full_forward() -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=300, **TINY_LLAMA)).eval()
    exact = copy.deepcopy(model).double()
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    embed = model.get_input_embeddings()
    runner = ReferenceRunner(model, None)
    kv = KvCache(KvShape.of(model.config, model.dtype, model.device), rows=2)
    logits, _ = runner.forward(kv, embed(ids[:, :12]), torch.ones(2, 12, dtype=torch.long), False)
    steps, pointers = [logits], set()
    for column in range(12, 20):
        one = torch.ones(2, 1, dtype=torch.long)
        logits, _ = runner.forward(kv, embed(ids[:, column : column + 1]), one, False)
        steps.append(logits)
        pointers.add(kv.keys.data_ptr())
    # 12 columns leave room for 16 more: eight steps, one buffer.
    assert len(pointers) == 1 and kv.width == 20
    full = model(input_ids=ids).logits[:, 11:]
    reference = exact(input_ids=ids).logits[:, 11:]
    assert_float32_close(torch.stack(steps, dim=1), full, reference)
