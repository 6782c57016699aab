"""Qwen3-Omni at concurrency: examples/pipelines/qwen3-omni.yaml's three stage
processes and an orchestrator process, as ``omni up`` runs them, with 1, 4, 8 and
16 requests at once, against the same 8 requests one by one.

    python benchmarks/omni_concurrency.py [--runs 3] [--sizes tiny small]
                                          [--levels 1 4 8 16] [--tokens 32] [--codes 48]

Two random checkpoints built here (services/engines/qwen_omni/tiny.py): ``tiny``
(what the example serves) and ``small``, whose compute dominates (thinker 512 wide,
8 layers, 8 experts; talker, code predictor and code2wav scaled alike). Every
request is greedy, its own prompt, ``--tokens`` thinker tokens and ``--codes``
talker codes at most; the thinker -> talker edge is the example's (streamed: the
prompt's part and the first token, then two tokens a window), talker -> code2wav
windows of 12 codes.

Reported per level (over all runs): time to first audio at the client (p50, p99),
real-time factor (time to the last audio over the audio's length, median), audio
seconds per wall second and requests per second of the wave, and underruns: each
request's audio played in real time from its first packet at the real model's
rate (1920 samples a code at 24 kHz: ``play_scale``), every packet that came after
the audio before it had run out (as first_audio.py judges gaps). Then, per run:
the 8 at once against the same 8 one by one (throughput, and median and p99 time
to first audio over the lone requests' median), and one request with a
``--long`` (128) token answer, streamed edge against ``window: -1``, which must
give the same codes and audio. How many requests at each level said exactly what
they said alone is reported, not required: tests/engines/qwen_omni hold every
request to the derived rule (float32 batching is not bit-invariant).

Targets (small): 8 at once >= 4x the one-by-one throughput; median first audio
at 8 <= 2x a lone request's, p99 <= 3x; no underrun at 8; the long answer's first
audio >= 4x sooner streamed. Tiny: the same figures, reported.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks._common import median, table, write_json
from benchmarks._omni_heard import Heard, hear, percentile, spread, wave
from orchestrator.cli.processes import OrchestratorProcess, StageProcess
from orchestrator.client import AsyncClient
from services.mesh.rpc.stage_client import StageClient

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "pipelines" / "qwen3-omni.yaml"
GPU_EXAMPLE = ROOT / "examples" / "pipelines" / "qwen3-omni-gpu.yaml"
CACHE = Path.home() / ".cache" / "omni-mesh"
REAL_SAMPLES_PER_CODE = 1920  # the real code2wav: 12.5 codes/s at 24 kHz
SAMPLE_RATE = 24000
SUBJECTS = (
    "a lighthouse keeper and a storm at sea", "a fox who learns to read", "the last train home",
    "a garden on the moon", "two rival bakers", "a clock that runs backwards",
    "a dragon afraid of heights", "a letter lost for fifty years", "a city under snow",
    "the robot who painted", "a map with no roads", "an orchestra of frogs",
    "a boy and a paper kite", "the quiet volcano", "a ship in a bottle", "a bridge of light",
)  # fmt: skip
PROMPTS = [f"Write a short story about {s}." for s in SUBJECTS]


# -- the mesh --------------------------------------------------------------------


def stage_files(
    folder: Path, model: Path, tokens: int, codes: int, example: Path = EXAMPLE
) -> dict[str, Path]:
    """The example's stage files, serving ``model``, with these answer lengths."""
    pipeline = yaml.safe_load(example.read_text())
    paths = {}
    for stage in pipeline["stages"]:
        config = yaml.safe_load((example.parent / stage["launch"]).read_text())
        config.pop("load_format", None)
        config["model"] = str(model)
        limit = {"thinker": tokens, "talker": codes}.get(config["name"])
        if limit is not None:
            config["defaults"] = {**config.get("defaults", {}), "max_tokens": limit}
        paths[config["name"]] = folder / f"{config['name']}.yaml"
        paths[config["name"]].write_text(yaml.safe_dump(config))
    return paths


def pipeline_file(
    path: Path, addresses: dict[str, str], streamed: bool, example: Path = EXAMPLE
) -> Path:
    edges = yaml.safe_load(example.read_text())["edges"]
    if not streamed:  # the talker after the thinker's whole answer
        edges[0] = {"from": "thinker", "to": "talker", "window": -1}
    config = {
        "name": "omni-streamed" if streamed else "omni-whole",
        "stages": [{"name": n, "address": a} for n, a in addresses.items()],
        "edges": edges,
        "outputs": ["thinker", "talker", "code2wav"],
    }
    path.write_text(yaml.safe_dump(config))
    return path


async def measure(size: str, args: argparse.Namespace) -> dict[str, Any]:
    """One checkpoint: ``size`` of tiny.py's, or "real" (``args.model`` on the GPU
    example's stages: benchmarks/omni_gpu.py --concurrency)."""
    from services.engines.qwen_omni import tiny

    if size == "real":
        model, example, play_scale = Path(args.model), GPU_EXAMPLE, 1.0
    else:
        model = await asyncio.to_thread(tiny.ensure, CACHE, tiny.SEED, size)
        z = tiny.SIZES[size]
        samples_per_code = math.prod(z["wav_upsample"]) * math.prod(z["wav_ratios"])
        example, play_scale = EXAMPLE, REAL_SAMPLES_PER_CODE / samples_per_code
    levels: dict[int, list[tuple[float, list[Heard]]]] = {n: [] for n in args.levels}
    one_by_one: list[tuple[float, list[Heard]]] = []
    long: dict[str, list[Heard]] = {"streamed": [], "whole": []}
    with tempfile.TemporaryDirectory() as tmp:
        files = stage_files(Path(tmp), model, args.tokens, args.codes, example)
        stages = {name: StageProcess(path) for name, path in files.items()}
        orchestrators: list[OrchestratorProcess] = []
        try:
            addresses = {name: await p.start() for name, p in stages.items()}
            for address in addresses.values():
                async with StageClient(address) as stage:
                    await stage.wait_ready(timeout_s=1800)
            clients = {}
            for streamed in (True, False):
                path = Path(tmp) / f"p{int(streamed)}.yaml"
                pipeline_file(path, addresses, streamed, example)
                orchestrators.append(OrchestratorProcess(path))
                clients[streamed] = AsyncClient(await orchestrators[-1].start())
                await clients[streamed].wait_ready(timeout_s=120)
            client = clients[True]
            await wave(client, PROMPTS[:2], "warm", play_scale)
            solo = PROMPTS[:8]
            long_params = {"params": {"max_tokens": args.long}}
            for run in range(args.runs):
                for n in args.levels:
                    levels[n].append(await wave(client, PROMPTS[:n], f"r{run}-n{n}", play_scale))
                    print(f"{size} run {run}: {n} at once in {levels[n][-1][0]:.1f} s", flush=True)
                began, alone = time.perf_counter(), []
                for i, prompt in enumerate(solo):
                    alone.append(await hear(client, prompt, f"r{run}-alone-{i}", play_scale))
                one_by_one.append((time.perf_counter() - began, alone))
                print(f"{size} run {run}: 8 one by one in {one_by_one[-1][0]:.1f} s", flush=True)
                for arm, streamed in (("streamed", True), ("whole", False)):
                    rid = f"r{run}-long-{arm}"
                    long[arm].append(
                        await hear(clients[streamed], PROMPTS[0], rid, play_scale, **long_params)
                    )
            for c in clients.values():
                await c.close()
        finally:
            for o in orchestrators:
                await o.stop()
            for p in stages.values():
                await p.stop()
    return report(size, args, play_scale, levels, one_by_one, long)


# -- the report ------------------------------------------------------------------


def as_alone(waves: list[tuple[float, list[Heard]]], alone: dict[int, str]) -> str:
    """Of the requests also served one by one: how many said the same ids and codes."""
    pairs = [(h.said, alone[i]) for _, hs in waves for i, h in enumerate(hs) if i in alone]
    return f"{sum(a == b for a, b in pairs)}/{len(pairs)}"


def report(
    size: str,
    args: argparse.Namespace,
    play_scale: float,
    levels: dict[int, list[tuple[float, list[Heard]]]],
    one_by_one: list[tuple[float, list[Heard]]],
    long: dict[str, list[Heard]],
) -> dict[str, Any]:
    alone_said = {i: h.said for i, h in enumerate(one_by_one[0][1])}
    rows = []
    for n, waves in levels.items():
        heard = [h for _, hs in waves for h in hs]
        firsts = [h.first_audio_s for h in heard]
        rows.append(
            {
                "at_once": n,
                "first_audio_p50_ms": percentile(firsts, 0.5) * 1e3,
                "first_audio_p99_ms": percentile(firsts, 0.99) * 1e3,
                "rtf_p50": median([h.real_time_factor for h in heard]),
                "audio_s_per_s": spread([sum(h.audio_s for h in hs) / w for w, hs in waves], 1),
                "requests_per_s": spread([n / w for w, _ in waves]),
                "underruns": sum(h.underruns for h in heard),
                "ids_codes_as_alone": as_alone(waves, alone_said),
                "requests": len(heard),
            }
        )
    eight = levels.get(8, [])
    throughput, p50_ratio, p99_ratio = [], [], []
    for (wall, hs), (alone_wall, alone) in zip(eight, one_by_one, strict=False):
        lone = median([h.first_audio_s for h in alone])
        throughput.append(alone_wall / wall)
        p50_ratio.append(median([h.first_audio_s for h in hs]) / lone)
        p99_ratio.append(percentile([h.first_audio_s for h in hs], 0.99) / lone)
    sooner = [
        w.first_audio_s / s.first_audio_s
        for s, w in zip(long["streamed"], long["whole"], strict=True)
    ]
    same_long = len({(h.said, h.audio) for arm in long.values() for h in arm}) == 1
    underruns_8 = sum(h.underruns for _, hs in eight for h in hs)
    ratios = {
        "throughput_8_vs_one_by_one": throughput,
        "first_audio_p50_8_vs_lone": p50_ratio,
        "first_audio_p99_8_vs_lone": p99_ratio,
        "long_first_audio_streamed_sooner": sooner,
    }
    return {
        "size": size,
        "runs": args.runs,
        "thinker_tokens": args.tokens,
        "talker_codes": args.codes,
        "long_tokens": args.long,
        "play_scale": play_scale,
        "rows": rows,
        "ratios": ratios,
        "long": {
            arm: {
                "first_audio_ms": [h.first_audio_s * 1e3 for h in hs],
                "done_ms": [h.done_s * 1e3 for h in hs],
                "audio_s": hs[0].audio_s,
            }
            for arm, hs in long.items()
        },
        "long_same_codes_and_audio": same_long,
        "targets": {
            "throughput_8_at_least_4x": bool(throughput) and min(throughput) >= 4,
            "first_audio_p50_8_at_most_2x": bool(p50_ratio) and max(p50_ratio) <= 2,
            "first_audio_p99_8_at_most_3x": bool(p99_ratio) and max(p99_ratio) <= 3,
            "no_underrun_at_8": underruns_8 == 0,
            "long_streamed_4x_sooner": min(sooner) >= 4 and same_long,
        },
    }


COLUMNS = ["at_once", "first_audio_p50_ms", "first_audio_p99_ms", "rtf_p50", "audio_s_per_s",
           "requests_per_s", "underruns", "ids_codes_as_alone", "requests"]  # fmt: skip


def show(result: dict[str, Any]) -> None:
    print(f"\n{result['size']}: {result['runs']} runs; audio played at the real model's rate "
          f"(x{result['play_scale']:g})")  # fmt: skip
    print(table(result["rows"], COLUMNS))
    for name, values in result["ratios"].items():
        said = f"{spread(values)} (median [min-max] over runs)" if values else "not measured"
        print(f"  {name}: {said}")
    same = result["long_same_codes_and_audio"]
    print(f"  long answer: the same codes and audio streamed and whole: {same}")
    print(f"  targets: {result['targets']}")


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--tokens", type=int, default=32, help="thinker tokens a request")
    parser.add_argument("--codes", type=int, default=48, help="talker codes a request")
    parser.add_argument("--long", type=int, default=128, help="the long answer's tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    arguments(parser)
    parser.add_argument("--sizes", nargs="+", choices=["tiny", "small"], default=["tiny", "small"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if max(args.levels) > len(PROMPTS):
        sys.exit(f"at most {len(PROMPTS)} at once")
    results = {}
    for size in args.sizes:
        results[size] = asyncio.run(measure(size, args))
        show(results[size])
    print(f"json: {write_json('omni_concurrency', {'results': results}, args.out)}")


if __name__ == "__main__":
    main()
