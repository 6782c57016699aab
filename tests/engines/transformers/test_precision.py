"""The transformers engine's precision (the stage file's ``dtype:``): what ``auto``
picks from what the CPU supports, each precision loading and generating, bfloat16
logits as close to a float64 reference as bfloat16's own rounding allows, and
hidden states that reach the next stage as float32 whatever the model runs in."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from services.engines.base import EngineRequest, EngineSettings, SamplingParams
from services.engines.transformers import TransformersEngine
from services.engines.transformers.config import CPU_DIFFERING, auto_dtype
from services.engines.transformers.weights.packed import (
    PackedLinear,
    bfloat16_supported,
    pack_linears,
)
from services.mesh.errors import InitFailed
from services.mesh.rpc.stage_client import StageClient
from services.mesh.tensors import codec
from services.stage.config import parse_stage_config
from services.stage.server import StageServer
from services.testing.configs import TINY_LLAMA, stage_config
from services.testing.engine_runs import collect, generate, tokens_of
from tests.helpers.float_error import assert_float32_close, row_errors
from tests.helpers.stage import chat
from tests.helpers.stage import collect as collect_stream

needs_bf16 = pytest.mark.skipif(
    not bfloat16_supported(), reason="this CPU has no native oneDNN bfloat16 kernels"
)


def test_auto_is_float32_on_a_cpu_with_or_without_bfloat16() -> None:
    # bfloat16 differs from float32 on some of the 32 fixed prompts (CPU_DIFFERING),
    # so it is never the default; without native kernels it would not be either.
    assert CPU_DIFFERING["bfloat16"] > 0
    assert auto_dtype("cpu", cpu_bfloat16=True) == "float32"
    assert auto_dtype("cpu", cpu_bfloat16=False) == "float32"
    assert auto_dtype("cuda:0", cpu_bfloat16=False) == "bfloat16"


def test_auto_would_take_bfloat16_only_where_it_agrees_and_the_cpu_has_it() -> None:
    agreeing = {"bfloat16": 0}
    assert auto_dtype("cpu", cpu_bfloat16=True, differing=agreeing) == "bfloat16"
    assert auto_dtype("cpu", cpu_bfloat16=False, differing=agreeing) == "float32"


def test_dtype_in_engine_args_is_refused_naming_the_stage_setting(omni_cache_dir: Path) -> None:
    with pytest.raises(InitFailed, match=r"stage file's own dtype:") as caught:
        TransformersEngine(
            EngineSettings(cache_dir=omni_cache_dir, engine_args={"dtype": "bfloat16"})
        )
    assert caught.value.field == "engine_args"


@pytest.mark.parametrize(
    ("dtype", "runs_in"),
    [("auto", torch.float32), pytest.param("bfloat16", torch.bfloat16, marks=needs_bf16)],
)
async def test_each_precision_loads_packed_and_generates(
    smollm2_gguf: Path, omni_cache_dir: Path, dtype: str | None, runs_in: torch.dtype
) -> None:
    # weights: packed, since auto would put a float32 GGUF's linears on its blocks.
    settings = EngineSettings(
        cache_dir=omni_cache_dir,
        max_batch_size=2,
        dtype=dtype,
        engine_args={"weights": "packed"},
    )
    engine = TransformersEngine(settings)
    info = engine.load(smollm2_gguf)
    try:
        model = engine.model
        assert model.dtype == runs_in
        packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
        assert len(packed) == 30 * 7 + 1
        assert {m.packed_weight.dtype for m in packed} == {runs_in}
        assert info.description.endswith(f"{30 * 7 + 1} packed for oneDNN")
        params = SamplingParams(max_tokens=8, temperature=0.0)
        request = EngineRequest("p", messages=(("user", "Why is the sky blue?"),), params=params)
        events = await collect(generate(engine, request))
        assert len(tokens_of(events)) == 8
        # The KV cache is in the model's dtype, and the memory plan counts it so.
        assert info.kv.dtype_bytes == runs_in.itemsize
    finally:
        engine.close()


def _tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, **TINY_LLAMA)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@needs_bf16
@torch.inference_mode()
def test_bfloat16_logits_are_as_close_as_bfloat16_rounding_allows() -> None:
    """Trusted: the float64 model with its weights rounded to bfloat16 (each off by at
    most 2^-8 relative, bfloat16's unit roundoff), computed exactly. The bfloat16 path
    rounds its activations by that same 2^-8 at every step, so it may be off by a few
    times as much (MULTIPLE, as for float32), and no more: measured 1.8x here."""
    model = _tiny_llama()
    exact = copy.deepcopy(model).double()
    rounded = copy.deepcopy(model).bfloat16().double()
    half = copy.deepcopy(model).bfloat16()
    assert pack_linears(half) == 2 * 7 + 1
    ids = torch.stack([torch.arange(12), torch.arange(100, 112)])
    reference, trusted = exact(input_ids=ids).logits, rounded(input_ids=ids).logits
    mine = half(input_ids=ids).logits
    assert mine.dtype == torch.bfloat16
    assert_float32_close(mine.float(), trusted, reference)
    # Not vacuous: the float32 model passes by far, a wrong bfloat16 weight does not.
    assert_float32_close(model(input_ids=ids).logits, trusted, reference)
    wrong = copy.deepcopy(model)
    weight = wrong.get_submodule("model.layers.1.mlp.down_proj").weight
    weight.add_(1e-2 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(1)))
    wrong = wrong.bfloat16()
    pack_linears(wrong)
    assert not row_errors(wrong(input_ids=ids).logits.float(), trusted, reference).ok


@needs_bf16
async def test_a_bfloat16_stage_sends_float32_hidden_states(
    omni_cache_dir: Path, smollm2_gguf: Path
) -> None:
    config = stage_config("thinker", omni_cache_dir, dtype="bfloat16")
    server = StageServer(parse_stage_config(config))
    port = await server.start("127.0.0.1", 0)
    try:
        async with StageClient(f"127.0.0.1:{port}") as client:
            await client.wait_ready(timeout_s=300)
            submit = chat("h", "Why is the sky blue?", max_tokens=4, return_hidden_states=True)
            result = (await collect_stream(client.generate(submit.submit)))["h"]
    finally:
        await server.stop(1.0)
    assert isinstance(server.engine, TransformersEngine)
    assert server.engine.model.dtype == torch.bfloat16
    rows = 0
    for segment in result.segments:
        for tensor in segment.tensors:
            hidden = codec.from_proto(tensor)
            assert tensor.dtype == "float32" and hidden.dtype == torch.float32
            assert hidden.shape[1] == 576 and hidden.isfinite().all()
            rows += hidden.shape[0]
    assert rows == len(result.token_ids) == 4
