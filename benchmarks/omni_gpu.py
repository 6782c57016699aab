"""Qwen3-Omni through the mesh against the monolithic ``generate``: time to first
audio and real-time factor.

    python benchmarks/omni_gpu.py --model /models/Qwen3-Omni-30B-A3B-Instruct \
        [--devices cuda:0,cuda:1,cuda:1] [--rounds 3] [--tokens 128]
    python benchmarks/omni_gpu.py --tiny     # the tiny random checkpoint on CPU

Three configurations, each answering the same prompt greedily:

    monolithic   Qwen3OmniMoeForConditionalGeneration.generate(return_audio=True)
                 in this process: the audio exists when generate returns
    mesh -1      thinker → talker → code2wav stage processes, talker → code2wav
                 window -1: code2wav decodes once the talker has finished
    mesh N       the same stages, window N = code2wav's chunk_size: each chunk is
                 decoded as the talker makes it

The two mesh configurations run interleaved round by round over the same three
stage processes. On a GPU the monolithic model runs first and is freed before
the stages load (both would not fit one GPU); with ``--tiny`` it runs in the
same rounds, interleaved with the mesh's, so all three see the same load (run
first, minutes apart on a shared machine, it read several times the mesh's
figure; docs/benchmarks.md). Every configuration runs torch at one thread per process.
The tiny talker answers PROMPT with 127 codes (--talker-tokens 128 caps it;
benchmarks/_omni.py), about 10 s of speech for the real model.

Reported per configuration: time to first audio and to the whole answer (p50
over rounds), audio seconds, RTF (time to the whole answer / audio seconds) and
time to first audio as a ratio to the monolithic. Without ``--tiny`` it needs
CUDA and the checkpoint folder, and exits 0 saying why it skipped otherwise.

``--concurrency`` runs benchmarks/omni_concurrency.py's measurement instead on the
real checkpoint (examples/pipelines/qwen3-omni-gpu.yaml's stages, its model set to
``--model``): 1, 4, 8 and 16 requests at once against the same 8 one by one, and
the long answer streamed against ``window: -1``; the same table and targets.

    python benchmarks/omni_gpu.py --concurrency --model /models/Qwen3-Omni-30B-A3B-Instruct
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from benchmarks import _omni as omni
from benchmarks._common import median, table, write_json
from orchestrator.cli.processes import StageProcess
from orchestrator.client import AsyncClient
from orchestrator.server.pipeline import parse_pipeline
from orchestrator.server.server import OrchestratorServer
from services.mesh.rpc.stage_client import StageClient

PROMPT, SAMPLE_RATE = omni.PROMPT, omni.SAMPLE_RATE


def skip_reason(args: argparse.Namespace) -> str | None:
    if args.tiny:
        return None
    if not torch.cuda.is_available():
        if getattr(args, "concurrency", False):
            return "no CUDA device (benchmarks/omni_concurrency.py: the same on CPU checkpoints)"
        return "no CUDA device (run with --tiny for the tiny checkpoint on CPU)"
    if args.model is None or not (Path(args.model) / "config.json").is_file():
        return f"no Qwen3-Omni checkpoint folder at --model {args.model}"
    return None


class Monolithic:
    """The whole model in this process; each call is one timed ``generate``
    (first audio = done: the audio exists when generate returns)."""

    def __init__(self, folder: Path, device: str, dtype: torch.dtype, args: Any) -> None:
        from transformers import Qwen3OmniMoeForConditionalGeneration

        from services.engines.qwen_omni import processor as processors

        loaded: Any = Qwen3OmniMoeForConditionalGeneration.from_pretrained(folder, dtype=dtype)
        self.model, self.device, self.args = loaded.to(device).eval(), device, args
        processor = processors.load(folder)
        text = processor.apply_chat_template(
            [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
        )
        self.inputs = processor(text=[text], return_tensors="pt").to(device)
        self()  # a warm-up, not counted

    def __call__(self) -> tuple[float, float, float]:
        began, args = time.perf_counter(), self.args
        _, audio = self.model.generate(
            **self.inputs, return_audio=True, thinker_max_new_tokens=args.tokens,
            thinker_eos_token_id=self.model.config.im_end_token_id, thinker_do_sample=False,
            talker_do_sample=False, talker_max_new_tokens=args.talker_tokens,
        )  # fmt: skip
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        took = time.perf_counter() - began
        return took, took, audio.shape[-1] / SAMPLE_RATE

    def close(self) -> None:
        del self.model
        gc.collect()
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()


def stage_files(folder: Path, model: str | None, devices: list[str], args: Any) -> dict[str, Path]:
    configs = omni.stage_configs(
        model, devices, tokens=args.tokens, talker_tokens=args.talker_tokens, chunk=args.chunk,
        tiny=args.tiny,
    )  # fmt: skip
    paths = {}
    for name, config in configs.items():
        paths[name] = folder / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump(config))
    return paths


async def one(client: AsyncClient, rid: str) -> tuple[float, float, float]:
    began, first, samples = time.perf_counter(), float("nan"), 0
    async for event in client.generate(PROMPT, request_id=rid):
        kind = event.WhichOneof("kind")
        if kind == "segment" and event.stage == "code2wav":
            for tensor in event.segment.tensors:
                if tensor.name == "audio":
                    first = first if first == first else time.perf_counter() - began
                    samples += tensor.shape[0]
        if kind == "done":
            if event.done.code:
                raise RuntimeError(f"{rid}: {event.done.code_name} {event.done.message}")
            return first, time.perf_counter() - began, samples / SAMPLE_RATE
    raise RuntimeError(f"{rid}: no Done")


async def mesh(
    model: str | None, devices: list[str], args: Any, local: Monolithic | None = None
) -> dict[str, list]:
    """The two mesh arms interleaved round by round, and ``local`` (the monolithic,
    when it fits beside the stages) in the same rounds: one load for all three."""
    windows = {"mesh -1": -1, "mesh N": args.chunk}
    with tempfile.TemporaryDirectory() as tmp:
        paths = stage_files(Path(tmp), model, devices, args)
        processes = {name: StageProcess(path) for name, path in paths.items()}
        servers: list[OrchestratorServer] = []
        samples: dict[str, list] = {label: [] for label in windows}
        if local is not None:
            samples = {"monolithic": [], **samples}
        try:
            addresses = {name: await p.start() for name, p in processes.items()}
            for address in addresses.values():
                async with StageClient(address) as stage:
                    await stage.wait_ready(timeout_s=1800)
            clients = {}
            for label, window in windows.items():
                pipeline = parse_pipeline({
                    "name": label.replace(" ", ""),
                    "stages": [{"name": n, "address": a} for n, a in addresses.items()],
                    "edges": omni.edges(window),
                    "outputs": ["thinker", "code2wav"],
                })  # fmt: skip
                server = OrchestratorServer(pipeline)
                servers.append(server)
                port = await server.start()
                await server.wait_ready(120)
                clients[label] = AsyncClient(f"127.0.0.1:{port}")
            await one(clients["mesh N"], "warm")
            for r in range(args.rounds):
                if local is not None:  # the stages idle meanwhile
                    samples["monolithic"].append(local())
                for label, client in clients.items():  # interleaved: the same load for each
                    samples[label].append(await one(client, f"{label[5:]}-{r}"))
            for client in clients.values():
                await client.close()
        finally:
            for server in servers:
                await server.stop()
            for process in processes.values():
                await process.stop()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Qwen3-Omni checkpoint folder")
    parser.add_argument("--tiny", action="store_true", help="the tiny random checkpoint, CPU")
    parser.add_argument("--devices", default="cuda:0,cuda:1,cuda:1", help="thinker,talker,code2wav")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128, help="thinker tokens")
    parser.add_argument("--talker-tokens", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=25, help="code2wav chunk_size = window N")
    parser.add_argument(
        "--concurrency", action="store_true", help="omni_concurrency.py's measurement, real model"
    )
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--codes", type=int, default=250, help="--concurrency: talker codes")
    parser.add_argument("--long", type=int, default=128, help="--concurrency: long answer")
    args = parser.parse_args()
    if args.concurrency and args.tiny:
        parser.error("--concurrency measures the real checkpoint: omni_concurrency.py serves tiny")
    if (why := skip_reason(args)) is not None:
        print(f"omni_gpu: skipped: {why}")
        return
    if args.concurrency:
        from benchmarks import omni_concurrency

        args.runs = args.rounds
        result = asyncio.run(omni_concurrency.measure("real", args))
        omni_concurrency.show(result)
        print(f"json: {write_json('omni_gpu_concurrency', result)}")
        return
    if args.tiny:
        from services.engines.qwen_omni import tiny

        cache = Path(tempfile.gettempdir()) / "omni-gpu-bench"
        folder, model, devices = tiny.ensure(cache), None, ["cpu"] * 3
        args.chunk, args.tokens = omni.TINY_CHUNK, omni.THINKER_TOKENS
        args.talker_tokens = omni.TALKER_TOKENS
        torch.set_num_threads(1)  # as each stage: 2 threads on 2 busy cores are far slower
        local = Monolithic(folder, "cpu", torch.float32, args)
        samples = asyncio.run(mesh(model, devices, args, local))
    else:
        folder, model, devices = Path(args.model), str(Path(args.model)), args.devices.split(",")
        local = Monolithic(folder, devices[0], torch.bfloat16, args)
        samples = {"monolithic": [local() for _ in range(args.rounds)]}
        local.close()  # both would not fit one GPU
        samples.update(asyncio.run(mesh(model, devices, args)))
    base = median([first for first, _, _ in samples["monolithic"]])
    rows = []
    for label, runs in samples.items():
        first, whole = median([r[0] for r in runs]), median([r[1] for r in runs])
        audio = median([r[2] for r in runs])
        rows.append({"config": label, "first_audio_ms_p50": first * 1e3,
                     "done_ms_p50": whole * 1e3, "audio_s": audio,
                     "rtf": whole / audio if audio else float("nan"),
                     "first_audio_vs_monolithic": base / first})  # fmt: skip
    columns = ["config", "first_audio_ms_p50", "done_ms_p50", "audio_s", "rtf",
               "first_audio_vs_monolithic"]  # fmt: skip
    print(table(rows, columns))
    result = {"model": "tiny" if args.tiny else args.model, "devices": devices, "rows": rows,
              "rounds": args.rounds, "chunk": args.chunk}  # fmt: skip
    name = "omni_tiny_cpu" if args.tiny else "omni_gpu"
    print(f"json: {write_json(name, result)}")


if __name__ == "__main__":
    main()
